"""The Slurm cluster of the Slurm tests: the one already running (sinfo answers, partition debug),
else the two-node one that ../shared/reference/slurm-local/start.sh starts on this machine (root;
it apt-installs slurm-wlm; nodes node1 and node2, 2 CPUs each), started once per test session by
the `slurm_env` fixture (tests/conftest.py) and stopped again at its end. Where neither is possible
the Slurm tests are skipped with the reason."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from warm.server import WARM_ENV

SLURM_LOCAL = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "slurm-local"


def _debug_partition_up(env: dict) -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%T"], capture_output=True, text=True, env=env)
    return out.returncode == 0 and bool(out.stdout.strip())


def slurm_cluster(directory_factory):
    """Yields the environment in which sbatch reaches a cluster with partition debug."""
    # the jobs' ranks start cold, as on a real cluster: the launcher is these tests' subject
    env = {name: value for name, value in os.environ.items() if name not in WARM_ENV}
    if _debug_partition_up(env):
        yield env
        return
    if subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode == 0:
        pytest.skip("a slurmctld runs but sinfo cannot reach partition debug: export SLURM_CONF=its slurm.conf")
    if not (SLURM_LOCAL / "start.sh").exists():
        pytest.skip(f"no Slurm running and no {SLURM_LOCAL}/start.sh to start one (../shared beside the checkout)")
    directory = directory_factory()
    started = subprocess.run(
        ["bash", str(SLURM_LOCAL / "start.sh"), str(directory)], capture_output=True, text=True, timeout=900
    )
    try:
        if started.returncode != 0:
            reason = " | ".join((started.stderr + started.stdout).strip().splitlines()[:5])
            pytest.skip(f"slurm-local/start.sh could not start Slurm (exit {started.returncode}): {reason}")
        env["SLURM_CONF"] = str(directory / "slurm.conf")
        yield env
    finally:  # exactly what start.sh started, by its pid files
        subprocess.run(["bash", str(SLURM_LOCAL / "stop.sh"), str(directory)], capture_output=True, timeout=60)


def job(job_id: str, env: dict) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, env=env)
    return dict(re.findall(r"(\w+)=(\S+)", out.stdout))


def job_state(job_id: str, env: dict) -> str | None:
    return job(job_id, env).get("JobState")


def ended_job(job_id: str, env: dict, wait_s: float = 30) -> dict:
    """The job once Slurm has it ended: submitit's result (which the sweep waits for) is written
    before the job's batch script returns, so for a moment the job can still be RUNNING."""
    deadline = time.monotonic() + wait_s
    while (found := job(job_id, env)) and found["JobState"] in ("RUNNING", "COMPLETING"):
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return found


class Following:
    """`parakit train` submitting to Slurm and following its job, in the background: its output
    lines as they come, the job id once submitted."""

    def __init__(self, args: list[str], env: dict, cwd: Path):
        import sys
        import threading

        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "toolkit.cli", "train", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def job_id(self, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while not (found := re.search(r"submitted Slurm job (\d+)", self.output)):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output[-3000:]
            time.sleep(0.2)
        return found.group(1)

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        return code


def wait_for_step(run_dir: Path, step: int, following: Following, timeout_s: float = 240) -> None:
    """Until rank 0 has logged `step` in the run's metrics.jsonl."""
    import json

    deadline = time.monotonic() + timeout_s
    log = run_dir / "metrics.jsonl"
    while not (log.exists() and any(json.loads(line).get("step", 0) >= step for line in log.read_text().splitlines())):
        assert following.proc.poll() is None, following.output[-3000:]
        assert time.monotonic() < deadline, f"step {step} not reached in {timeout_s} s: " + following.output[-3000:]
        time.sleep(0.2)


def kill_node(job_id: str, node: str) -> list[int]:
    """A node dies: every process of the job's step on `node` (the torchrun agent and its ranks,
    found by their SLURM_JOB_ID and SLURMD_NODENAME) is killed at once, with no chance to clean up."""
    import signal

    killed = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ and f"SLURMD_NODENAME={node}".encode() in environ:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(int(proc.name))
            except (ProcessLookupError, ValueError):
                pass
    return killed
