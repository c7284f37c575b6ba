"""`parakit train` on several nodes: submit the run directory's launch.sh to Slurm with sbatch, print
the job id and where its logs go, and follow them until the job ends (unless --detach).

The batch script is the run directory's launch.sh, exactly what a user would submit by hand (and
what --dry-run prints); parakit adds only where the job's own log goes. A job that outlives
parakit (Ctrl-C while following, --detach) keeps running: squeue and scancel reach it.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from toolkit.config.schema import Config

# Slurm's job states from which a job does not come back by itself (squeue(1), JOB STATE CODES)
ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
)


def log_dir(cfg: Config, run_dir: Path) -> Path:
    return Path(cfg.cluster.slurm.log_dir) if cfg.cluster.slurm.log_dir else run_dir / "logs"


def sbatch_command(cfg: Config, run_dir: Path) -> list[str]:
    """sbatch with the job's own log in the log directory (launch.sh's #SBATCH lines say the rest)."""
    logs = log_dir(cfg, run_dir)
    command = ["sbatch", "--parsable"]
    if not cfg.cluster.slurm.log_dir:  # else the script's own #SBATCH --output says it
        command += [f"--output={logs}/%x-%j.out", "--open-mode=append"]
    return [*command, str(run_dir / "launch.sh")]


def by_hand(cfg: Config, run_dir: Path) -> str:
    """How to start the run without Slurm: launch.sh on every node."""
    return (
        f"run it by hand on each of the {cfg.cluster.nodes} nodes (a filesystem they share holds {run_dir}):\n"
        f"  MASTER_ADDR=<first node's address> RDZV_ID=<any id, the same on every node> {run_dir / 'launch.sh'}"
    )


def dry_run(cfg: Config, run_dir: Path) -> int:
    print(f"--- {run_dir / 'launch.sh'} (the batch script)")
    print((run_dir / "launch.sh").read_text(), end="")
    print("---")
    print(f"would submit: cd {shlex.quote(str(run_dir))} && {shlex.join(sbatch_command(cfg, run_dir))}")
    print("dry run: nothing submitted")
    return 0


def submit(cfg: Config, run_dir: Path, detach: bool) -> int:
    """sbatch launch.sh from the run directory; follow the job's logs to its end unless `detach`."""
    if shutil.which("sbatch") is None:
        print(
            f"parakit train: {cfg.cluster.nodes} nodes need Slurm, and this machine has no sbatch.\n"
            + by_hand(cfg, run_dir),
            file=sys.stderr,
        )
        return 2
    logs = log_dir(cfg, run_dir)
    logs.mkdir(parents=True, exist_ok=True)  # Slurm does not create the directory of --output
    done = subprocess.run(sbatch_command(cfg, run_dir), cwd=run_dir, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"parakit train: sbatch refused the job: {done.stderr.strip()}", file=sys.stderr)
        return 1
    job_id = done.stdout.strip().split(";")[0]  # --parsable: "ID" or "ID;CLUSTER"
    print(f"parakit train: submitted Slurm job {job_id}; run directory {run_dir}; logs {logs}", flush=True)
    if detach:
        print(f"  follow it: squeue -j {job_id}; tail -f {logs}/*-{job_id}*; stop it: scancel {job_id}")
        return 0
    try:
        state = follow(job_id, logs)
    except KeyboardInterrupt:
        print(f"\nparakit train: stopped following; job {job_id} keeps running (scancel {job_id} stops it)")
        return 130
    print(f"parakit train: Slurm job {job_id} ended {state}", flush=True)
    return 0 if state == "COMPLETED" else 1


def job_state(job_id: str) -> str | None:
    """The job's state as scontrol knows it (for MinJobAge after it ends), None when unknown."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    found = re.search(r"\bJobState=(\S+)", out.stdout)
    return found.group(1) if found else None


def follow(job_id: str, logs: Path, poll_s: float = 1.0) -> str:
    """Print the job's log lines as they come (a node's log prefixed by the node) until the job
    ends, a requeue included; its final state."""
    read: dict[Path, int] = {}
    while True:
        state = job_state(job_id)
        ended = state is None or state in ENDED  # read once more after the end: the last lines
        for path in sorted(logs.glob(f"*-{job_id}*")):
            with path.open("rb") as f:
                f.seek(read.get(path, 0))
                chunk = f.read()
            whole = chunk if ended else chunk[: chunk.rfind(b"\n") + 1]  # whole lines until the end
            read[path] = read.get(path, 0) + len(whole)
            node = re.match(rf"node-(.+)-{job_id}\.log$", path.name)
            for line in whole.decode(errors="replace").splitlines():
                print(f"[{node.group(1)}] {line}" if node else line, flush=True)
        if ended:
            return state or "UNKNOWN (scontrol no longer knows the job)"
        time.sleep(poll_s)
