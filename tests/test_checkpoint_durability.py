"""What parakit calls saved is on disk: the system calls of one-rank runs of both backends (sync and
asynchronous saves), read with strace, show every file of a checkpoint and every folder in it
fsynced before the rename that publishes it, the checkpoint folder fsynced after that rename and
again after `latest` is renamed into place, and pruning only after that (PostgreSQL's
durable_rename order). A save that left out any one of these fsyncs would lose the checkpoint it
announced, with the one before it pruned, at a power loss within the page cache's write-back."""

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import training_runs
from warm.server import WARM_ENV

from toolkit.train import checkpoint as ckpt

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("no_processes_left_behind"),
    pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (Debian package strace)"),
]

TRACED = "fsync,fdatasync,rename,renameat,renameat2,unlink,unlinkat,rmdir"
COMMON = [
    "model=tiny",
    "model.vocab_size=2048",
    "data=synthetic",
    "cluster.gpus_per_node=1",
    "train.steps=3",
    "train.global_batch=2",
    "checkpoint.interval_steps=1",
    "checkpoint.keep_last=2",  # step 1 is pruned when step 3 is published
]


@dataclass
class Call:
    name: str
    paths: list[str]  # the paths it acted on, absolute (strace -y names a descriptor's file)


def _paths(name: str, args: str) -> list[str]:
    if name in ("fsync", "fdatasync"):
        return re.findall(r"<([^>]*)>", args)[:1]
    quoted = re.findall(r'"((?:[^"\\]|\\.)*)"', args)
    if name in ("unlinkat", "renameat", "renameat2"):  # (dirfd<dir>, "name", ...) pairs
        dirs = re.findall(r"(?:^|, )(?:\d+<([^>]*)>|AT_FDCWD)", args)
        return [os.path.join(d, q) if d else q for d, q in zip(dirs, quoted)]
    return quoted


def completed_calls(log: Path) -> list[Call]:
    """The traced calls that succeeded, in the order they completed (a call another thread
    interrupted completes at its `<... resumed>` line)."""
    calls, pending = [], {}
    for line in log.read_text().splitlines():
        found = re.match(r"(\d+)\s+(?:<\.\.\. (\w+) resumed>(.*)|(\w+)\((.*))$", line)
        if not found:
            continue
        pid, resumed, rest, name, args = found.groups()
        if resumed:
            name, args = pending.pop(pid)
            args += rest
        elif args.endswith("<unfinished ...>"):
            pending[pid] = (name, args[: -len("<unfinished ...>")])
            continue
        if re.search(r"\) += 0\b", args):
            calls.append(Call(name, _paths(name, args)))
    return calls


def traced_run(tmp_path: Path, *overrides: str) -> tuple[Path, list[Call]]:
    """`parakit train` in a fresh interpreter under strace (not the suite's warm one: its ranks are
    forked by a server strace does not follow)."""
    run_dir, log = tmp_path / "run", tmp_path / "strace.log"
    env = {name: value for name, value in os.environ.items() if name not in WARM_ENV}
    command = ["strace", "-f", "--seccomp-bpf", "-qq", "-y", "-e", f"trace={TRACED}", "-o", str(log)]
    command += [sys.executable, "-m", "toolkit.cli", "train", *COMMON, *overrides, f"hydra.run.dir={run_dir}"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return run_dir, completed_calls(log)


def _index(calls: list[Call], name_prefix: str, paths: list[str], after: int = -1) -> int:
    return next(i for i, c in enumerate(calls) if i > after and c.name.startswith(name_prefix) and c.paths == paths)


def _synced(calls: list[Call], path: Path | str, after: int, before: int) -> bool:
    """Whether `path` was fsynced between the two calls, or renamed into place there from a file
    that had been (a temporary file written, fsynced and renamed)."""
    for i in range(after + 1, before):
        call = calls[i]
        if call.name in ("fsync", "fdatasync") and call.paths == [str(path)]:
            return True
        if call.name.startswith("rename") and call.paths[1:] == [str(path)] and _synced(calls, call.paths[0], -1, i):
            return True
    return False


def assert_published_durably(calls: list[Call], root: Path, step: int) -> int:
    """The published checkpoint of `step` went to disk in the durable order; the index of the
    rename that put `latest` in place."""
    final, staging = root / ckpt.step_name(step), ckpt.partial_dir(root, step)
    published = _index(calls, "rename", [str(staging), str(final)])
    for path in sorted(final.rglob("*")):
        inside = staging / path.relative_to(final)
        assert _synced(calls, inside, -1, published), f"{inside} was not fsynced before the publishing rename"
    manifest_in = max(i for i, c in enumerate(calls[:published]) if c.paths[-1:] == [str(staging / ckpt.MANIFEST)])
    for folder in [staging, *(staging / p.relative_to(final) for p in final.rglob("*") if p.is_dir())]:
        assert _synced(calls, folder, manifest_in, published), f"{folder} was not fsynced before the rename"
    latest = next(
        i
        for i, c in enumerate(calls)
        if i > published and c.name.startswith("rename") and c.paths[-1:] == [str(root / ckpt.LATEST)]
    )
    assert _synced(calls, root, published, latest), "the checkpoint folder was not fsynced after the rename"
    assert _synced(calls, root, latest, len(calls)), "the checkpoint folder was not fsynced after `latest`"
    return latest


@pytest.mark.parametrize(
    "save",
    [["backend=megatron"], ["backend=megatron", "checkpoint.async_save=true"], ["backend=deepspeed"]],
    ids=["megatron", "megatron-async", "deepspeed"],
)
def test_a_published_checkpoint_is_on_disk_before_latest_names_it(tmp_path, save):
    run_dir, calls = traced_run(tmp_path, *save)
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000003"]
    assert_published_durably(calls, root, 2)
    latest = assert_published_durably(calls, root, 3)
    pruned = [i for i, c in enumerate(calls) if any(p.startswith(str(root / "step_00000001")) for p in c.paths)]
    pruned = [i for i in pruned if calls[i].name in ("unlink", "unlinkat", "rmdir")]
    assert pruned and min(pruned) > latest, "step 1 was pruned before step 3 was published and named"


@pytest.fixture
def small_filesystem(tmp_path):
    """A 16 MiB tmpfs (one tiny checkpoint at vocabulary 2048 is 11 MB: the second save cannot fit)."""
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root needed): {mounted.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_a_full_disk_is_named_and_the_previous_checkpoint_stays(tmp_path, small_filesystem, backend):
    """On a real full filesystem: a warning before the save that will not fit, then one line naming
    the folder, the bytes and the fix (exit 1, no traceback); the unfinished save is removed and
    the previous checkpoint verifies."""
    root = small_filesystem / "checkpoints"
    overrides = [o for o in COMMON if not o.startswith("checkpoint.keep_last")] + ["checkpoint.keep_last=1"]
    result = training_runs.run(tmp_path, "run", *overrides, f"backend={backend}", f"checkpoint.dir={root}")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "warning [checkpoint_space]" in result.stderr and "Traceback" not in result.stderr
    said = [line for line in result.stderr.splitlines() if "ran out of space" in line]
    assert len(said) == 1 and f"checkpoint.dir {root} ran out of space" in said[0], result.stderr[-3000:]
    assert re.search(r"needs about [\d.]+ MiB .* and [\d.]+ MiB was free", said[0]) and "Fix: " in said[0]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
    assert ckpt.verify(root / "step_00000001") is None
