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
        f"  MASTER_ADDR=<first node's address> RDZV_ID=<any id, the same on every node> "
        f"{shlex.quote(str(run_dir / 'launch.sh'))}"
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
        print(
            f"parakit train: sbatch refused the job: {done.stderr.strip()}\n"
            "fix what it names (cluster.slurm.* sets the batch options) or, with no Slurm cluster to submit to, "
            + by_hand(cfg, run_dir),
            file=sys.stderr,
        )
        return 1
    job_id = done.stdout.strip().split(";")[0]  # --parsable: "ID" or "ID;CLUSTER"
    print(f"parakit train: submitted Slurm job {job_id}; run directory {run_dir}; logs {logs}", flush=True)
    if detach:
        print(f"  follow it: squeue -j {job_id}; tail -f {logs}/*-{job_id}[.-]*; stop it: scancel {job_id}")
        return 0
    try:
        state = follow(job_id, logs)
    except KeyboardInterrupt:
        print(f"\nparakit train: stopped following; job {job_id} keeps running (scancel {job_id} stops it)")
        return 130
    print(f"parakit train: Slurm job {job_id} ended {state}", flush=True)
    if state == "COMPLETED":
        return 0
    batch_logs = sorted(logs.glob(f"*-{job_id}.out"))
    if found := what_failed(batch_logs[0].read_text(errors="replace") if batch_logs else ""):
        print(f"parakit train: {found}", flush=True)
    return 1


def what_failed(batch_log: str) -> str | None:
    """The node that took the job down, from srun's errors in the batch log: a node Slurm saw
    fail, else one whose task was killed by a signal (its processes vanished: the node died or
    was killed), else the first whose task exited with an error (the others follow it, since
    srun --kill-on-bad-exit ends the step)."""
    if failed := re.search(r"srun: error: Node failure on (\S+)", batch_log):
        return f"node {failed.group(1)} was lost: Slurm saw it fail ({failed.group(0)})"
    tasks = re.findall(r"srun: error: (\S+): tasks? ([\d,-]+): (.+)", batch_log)
    for node, task, how in tasks:
        if how.strip() in ("Killed", "Terminated", "Segmentation fault", "Aborted") or "signal" in how:
            return (
                f"node {node} was lost: its task {task} was {how.strip().lower()} (its processes vanished); the "
                "other nodes' ranks stopped with it"
            )
    if tasks:
        node, task, how = tasks[0]
        return f"node {node} failed first: its task {task} {how.strip()} (its log: the node's log in the log directory)"
    return None


def _job_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S+)", out.stdout))


def job_state(job_id: str) -> str | None:
    """The job's state as scontrol knows it (for MinJobAge after it ends), None when unknown."""
    return _job_fields(job_id).get("JobState")


def _node_names(job_id: str) -> list[str]:
    """The job's nodes in order: a node log's index (srun --output %n) names one of them."""
    nodes = _job_fields(job_id).get("NodeList", "")
    out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True)
    return out.stdout.split()


def follow(job_id: str, logs: Path, poll_s: float = 1.0) -> str:
    """Print the job's log lines as they come (a node's log prefixed by the node) until the job
    ends, a requeue included; its final state."""
    read: dict[Path, int] = {}
    names: list[str] = []
    while True:
        state = job_state(job_id)
        ended = state is None or state in ENDED  # read once more after the end: the last lines
        if state == "PENDING":  # (again, when requeued): its nodes may change
            names = []
        for path in sorted([*logs.glob(f"*-{job_id}.out"), *logs.glob(f"*-{job_id}-node*.log")]):
            with path.open("rb") as f:
                f.seek(read.get(path, 0))
                chunk = f.read()
            whole = chunk if ended else chunk[: chunk.rfind(b"\n") + 1]  # whole lines until the end
            read[path] = read.get(path, 0) + len(whole)
            prefix = ""
            if node := re.search(r"-node(\d+)\.log$", path.name):
                names = names or _node_names(job_id)
                index = int(node.group(1))
                prefix = f"[{names[index] if index < len(names) else 'node ' + node.group(1)}] "
            for line in whole.decode(errors="replace").splitlines():
                print(prefix + line, flush=True)
        if ended:
            return state or "UNKNOWN (scontrol no longer knows the job)"
        time.sleep(poll_s)
