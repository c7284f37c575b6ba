"""A checkpoint folder's free space: said before a save that will not fit, and a save that runs
out of it (ENOSPC, EDQUOT) ends the run in one line instead of a traceback.

A save needs room for a whole new checkpoint while the older ones are still there: they are pruned
only after the new one is published (toolkit.train.checkpoint_retention). Its size is the newest
published checkpoint's (its manifest lists every file's bytes), else the planner's estimate
(toolkit.plan.checkpoint.checkpoint_bytes). A save that fails for space leaves the previous
checkpoint as it was (resumable) and its own staging folder removed; `parakit train` exits 1.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import sys
from pathlib import Path

from toolkit.train.checkpoint_retention import MANIFEST, published_in_order

FULL = (errno.ENOSPC, errno.EDQUOT)
# Writers that lose the errno on the way (torch.save's zip writer raises a RuntimeError, "unexpected
# pos"): a filesystem with less than this left is taken as the cause.
NEARLY_FULL_BYTES = 1 << 20


class CheckpointSpaceError(RuntimeError):
    """A save that ran out of space: the folder, the bytes needed and free, and the fix."""


def _size(count: float) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def free_bytes(root: Path) -> int:
    """What an unprivileged writer can still write under `root` (the nearest existing folder's filesystem)."""
    folder = root
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def last_checkpoint_bytes(root: Path) -> int | None:
    """The size of the newest published checkpoint under `root`, from its manifest; None without one."""
    import json

    for newest in reversed(published_in_order(root)) if root.is_dir() else []:
        try:
            files = json.loads((newest / MANIFEST).read_text())["files"]
            return sum(entry["bytes"] for entry in files.values())
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def needed_bytes(root: Path, estimate: float) -> tuple[int, str]:
    """The bytes the next save needs, and where the figure comes from."""
    last = last_checkpoint_bytes(root)
    return (last, "the last checkpoint's size") if last else (int(estimate), "the planner's estimate")


def _fix(root: Path) -> str:
    return (
        f"Fix: free space under {root}, set checkpoint.dir to a larger filesystem, or lower checkpoint.keep_last "
        "(older checkpoints are deleted only after a new one is published)"
    )


def warn_if_short(root: Path, estimate: float) -> None:
    """(rank 0, before a save) A warning with the numbers when the next checkpoint will not fit."""
    needed, source = needed_bytes(root, estimate)
    free = free_bytes(root)
    if free < needed:
        print(
            f"warning [checkpoint_space] {root} has {_size(free)} free and the next checkpoint needs about "
            f"{_size(needed)} ({source}): the save will fail. {_fix(root)}",
            file=sys.stderr,
            flush=True,
        )


def out_of_space(error: BaseException, root: Path) -> bool:
    """Whether `error` (or one it was raised from or wraps) is a full disk or quota, or the
    filesystem under `root` is full now (for writers whose errors lose the errno)."""
    seen, pending = set(), [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in FULL:
            return True
        pending += [current.__cause__, current.__context__]
        for failure in getattr(current, "failures", {}).values():  # DCP's CheckpointException: rank -> (error, trace)
            pending.append(failure[0] if isinstance(failure, tuple) else failure)
    return free_bytes(root) < NEARLY_FULL_BYTES


@contextlib.contextmanager
def space_named(root: Path, estimate: float):
    """Around a save (and the publication of one in flight): a failure for space becomes a
    CheckpointSpaceError of one line, with this rank's staging folders removed."""
    free_before = free_bytes(root)
    try:
        yield
    except CheckpointSpaceError:
        raise
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt) or not out_of_space(error, root):
            raise
        for staging in root.glob(".step_*.partial"):
            shutil.rmtree(staging, ignore_errors=True)
        needed, source = needed_bytes(root, estimate)
        raise CheckpointSpaceError(
            f"checkpoint.dir {root} ran out of space while saving: the checkpoint "
            f"needs about {_size(needed)} ({source}) and {_size(free_before)} was free when it began; the "
            f"unfinished save is removed, the previous checkpoint kept and resumable. {_fix(root)}"
        ) from None
