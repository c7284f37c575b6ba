"""The machine at hand, measured: the default CPU cluster's constants come from a probe of it.

conf/cluster/cpu.yaml writes its constants as `${probed:FIELD,GUESS}`: FIELD of this machine's
probe (`parakit probe`; toolkit/train/machine_probe.py measures, toolkit/plan/machine_fit.py
fits), or GUESS with PARAKIT_PROBE=0. The probe runs once per machine, the first time a CPU
cluster is composed, and is cached under $PARAKIT_CACHE_DIR (default: probe/ in
toolkit.config.cache.cache_root()) in a file named by the machine's fingerprint (processor, cores,
the torch, megatron-core and DeepSpeed versions, the probe's own version): another machine, or a
new torch, probes again.

On a CUDA machine `parakit probe` measures the GPUs instead (machine_probe.probe_gpu), every time;
its figures are kept under a fingerprint that adds the GPUs, and reach the planner through the
cluster file it writes (the GPU's datasheet file with them), never through `probed`.

A run directory's config.yaml holds the resolved numbers, so a run is planned and reported with
the constants it was trained with, wherever it is read later.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from toolkit.config.cache import cache_root

PROBE_VERSION = 7  # bumped when what the probe measures or fits changes: caches probe again
CACHE_ENV = "PARAKIT_CACHE_DIR"
PROBE_ENV = "PARAKIT_PROBE"  # 0: the guesses in the cluster file; the probe sets it for itself
_loaded: dict | None = None


class ProbeError(RuntimeError):
    pass


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


@functools.cache
def _fingerprint() -> str:
    return json.dumps(
        {
            "processor": _processor(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "python": platform.python_version(),
            "torch": _version("torch"),
            "megatron-core": _version("megatron-core"),
            "deepspeed": _version("deepspeed"),
            "probe": PROBE_VERSION,
        },
        sort_keys=True,
    )


def fingerprint(device: str = "cpu") -> dict:
    """What a probe's figures depend on (on a GPU also the GPUs, their count and CUDA's version)."""
    print_ = json.loads(_fingerprint())
    if device == "cuda":
        import torch

        count = torch.cuda.device_count()
        print_ |= {"gpu": torch.cuda.get_device_name(0), "gpus": count, "cuda": torch.version.cuda}
    return print_


def cuda_gpus() -> int:
    """How many CUDA GPUs torch sees on this machine (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def probe_device() -> str:
    """ "cuda" where torch sees a GPU (`parakit probe` then measures the GPUs), else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cache_dir() -> Path:
    """$PARAKIT_CACHE_DIR, else probe/ under parakit's cache (the checkout's .cache/ when run from
    one): the main job, a shell that only activated the venv and the tests find the same probe."""
    return Path(os.environ.get(CACHE_ENV) or cache_root() / "probe")


def cache_path(print_: dict | None = None) -> Path:
    digest = hashlib.sha1(json.dumps(print_ or fingerprint(), sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / f"probe-{digest}.json"


@contextlib.contextmanager
def _locked(path: Path):
    """One probe at a time per cache file (two parakit processes composing at once wait for one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_probe(force: bool = False, device: str = "cpu", write_dir: str | Path = ".") -> dict:
    """This machine's probe: the cached one, or a new one (then cached). Progress on stderr.
    device="cuda": its GPUs, always measured anew (nothing composes from that cache: the cluster
    file `parakit probe` writes holds the figures). Either measures the checkpoint write bandwidth
    in `write_dir`."""
    print_ = fingerprint(device)
    target = cache_path(print_)
    with _locked(target):
        if target.is_file() and not force and device == "cpu":
            return json.loads(target.read_text())
        if device == "cuda":
            message = f"parakit: measuring this machine's GPUs for the planner (kept in {target}): about a minute"
        else:
            message = (
                f"parakit: measuring this machine for the planner (once; cached in {target}; `parakit probe` "
                f"re-measures, {PROBE_ENV}=0 uses the guesses): about a minute"
            )
        print(message, file=sys.stderr, flush=True)
        command = [sys.executable, "-m", "toolkit.train.machine_probe", "--write-dir", str(write_dir)]
        if device == "cuda":
            command += ["--device", "cuda"]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "probe.json"
            env = {**os.environ, PROBE_ENV: "0"}
            done = subprocess.run([*command, "--output", str(out)], env=env)
            if done.returncode or not out.is_file():
                raise ProbeError(f"the machine probe failed (exit {done.returncode}); {PROBE_ENV}=0 plans with guesses")
            result = json.loads(out.read_text())
        result["fingerprint"] = print_
        partial = target.with_suffix(".partial")
        partial.write_text(json.dumps(result, indent=1))
        partial.replace(target)  # never a half-written cache
        return result


def probed(name: str, guess=None):
    """The `probed` resolver: FIELD of this machine's probe (GUESS with PARAKIT_PROBE=0)."""
    global _loaded
    if os.environ.get(PROBE_ENV) == "0":
        return {} if name == "stack" and guess is None else guess
    if _loaded is None or _loaded.get("fingerprint") != fingerprint():
        _loaded = run_probe()
    constants = {**_loaded["constants"], "stack": _loaded["stack"]}
    if name not in constants:
        raise ProbeError(f"${{probed:{name}}}: the probe measures no {name}; it gives {', '.join(sorted(constants))}")
    return constants[name]
