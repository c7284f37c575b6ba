"""Sweep points as Slurm jobs: what `hydra/launcher=slurm` (hydra_plugins.parakit_slurm) does on
top of hydra-submitit-launcher's `submitit_slurm`.

Each point is one Slurm job of one task on one node, in which the Hydra job runs (pickled by
submitit) and starts the point's ranks with torchrun inside the allocation. So a point asks for
cpus_per_task = its ranks on CPU clusters and gpus_per_node = its ranks on GPU clusters; points
needing the same are submitted together as one job array. Points already recorded in sweep.json are
not submitted again. Jobs are watched from here: a progress line as each point finishes, the job's
exit code handed to the caller, and a point whose Slurm job died (time limit, node failure, sbatch
refusing the request) recorded as failed so that the sweep goes on.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from toolkit.report.sweep import FINISHED, SweepOptions, columns, point_key, progress_line, read_rows, record

log = logging.getLogger(__name__)

PLUGIN = "hydra-submitit-launcher==1.2.0"
SLURM_LAUNCHERS = ("slurm", "submitit_slurm")


def launcher_problem(overrides: Sequence[str]) -> str | None:
    """Why `hydra/launcher=slurm|submitit_slurm` among the overrides cannot submit here, or None."""
    import importlib.util

    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra/launcher=")]
    if not chosen or chosen[-1] not in SLURM_LAUNCHERS:
        return None
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        return (
            f"hydra/launcher={chosen[-1]} needs Hydra's submitit plugin, which is not installed: "
            f"pip install {PLUGIN} -c constraints.txt (or drop hydra/launcher to run the points here)"
        )
    if shutil.which("sbatch") is None:
        return (
            f"hydra/launcher={chosen[-1]} submits each point with sbatch, which is not on PATH: run the sweep "
            "where Slurm's commands are (a login node), or drop hydra/launcher to run the points here"
        )
    return None


def resources(job_cfg, params: dict) -> dict:
    """The Slurm request of one point: one task (torchrun starts the ranks) on one node, with a CPU
    per rank on CPU clusters or a GPU per rank on GPU clusters, unless the launcher config sets it."""
    ranks = int(job_cfg.cluster.nodes) * int(job_cfg.cluster.gpus_per_node)
    device = job_cfg.cluster.device
    on_cpu = getattr(device, "name", str(device)) == "cpu"
    request = {"nodes": 1, "tasks_per_node": 1}  # more tasks would run the Hydra job once per task
    if on_cpu and params.get("cpus_per_task") is None:
        request["cpus_per_task"] = ranks
    if not on_cpu and params.get("gpus_per_node") is None:
        request["gpus_per_node"] = ranks
    return request


def _executor(params: dict):
    """A submitit Slurm executor with the launcher's parameters, as submitit_slurm builds it."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    executor = submitit.AutoExecutor(
        folder=params["submitit_folder"], cluster="slurm", slurm_max_num_timeout=params["max_num_timeout"]
    )
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(
        **{
            k if k in shared else f"slurm_{k}": v
            for k, v in params.items()
            if k not in ("submitit_folder", "max_num_timeout")
        }
    )
    return executor


def _failed_row(key: str, status: str, error: str) -> dict:
    return dict.fromkeys(columns()) | {"point": key, "status": status, "error": error, "run_dir": ""}


def launch(launcher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list:
    """ParakitSlurmLauncher.launch: submit the points, wait for them, one JobReturn per point."""
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobReturn, JobStatus, filter_overrides

    if shutil.which("sbatch") is None:
        raise RuntimeError(launcher_problem(["hydra/launcher=slurm"]))
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    opts = SweepOptions(total_points=len(job_overrides), started=time.time())
    exit_codes = getattr(launcher.task_function, "exit_codes", None)  # the caller's worst-exit-code list
    returns: list[Any] = [None] * len(job_overrides)
    finished = 0

    def report(i: int, code: int, row: dict | None, job_id: str = "") -> None:
        nonlocal finished
        finished += 1
        returns[i] = JobReturn(overrides=list(job_overrides[i]), status=JobStatus.COMPLETED, _return_value=code)
        if exit_codes is not None and isinstance(code, int):
            exit_codes.append(code)
        if row is None:  # a multirun of another command: no sweep.json row to show
            row = {"point": point_key(job_overrides[i]), "status": f"exit {code}"}
        where = f" [slurm job {job_id}]" if job_id else ""
        print(progress_line(row, finished, opts) + where, flush=True)

    recorded = {r["point"]: r for r in read_rows(sweep_dir)}
    groups: dict[tuple, list[int]] = {}
    for i, overrides in enumerate(job_overrides):
        row = recorded.get(point_key(overrides))
        if row and row.get("status") in FINISHED:
            report(i, 0, {**row, "skipped": True})
            continue
        job_cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
        groups.setdefault(tuple(sorted(resources(job_cfg, launcher.params).items())), []).append(i)

    jobs = {}  # submitit job -> index of its point
    for request, indices in groups.items():
        executor = _executor({**launcher.params, **dict(request)})
        job_params = [
            (list(job_overrides[i]), "hydra.sweep.dir", initial_job_idx + i, f"job_id_for_{i}", Singleton.get_state())
            for i in indices
        ]
        try:
            submitted = executor.map_array(launcher, *zip(*job_params))
        except Exception as e:  # sbatch refused: a wrong partition or account, more CPUs than a node has
            # Not recorded (a re-run with the launcher fixed submits them), but the sweep exits 1.
            why = " ".join(str(e).split())
            print(f"parakit sweep: sbatch refused {dict(request)} for {len(indices)} point(s): {why}", file=sys.stderr)
            for i in indices:
                report(i, 1, {"point": point_key(job_overrides[i]), "status": "not submitted (sbatch refused it)"})
            continue
        for i, job in zip(indices, submitted):
            point = " ".join(filter_overrides(job_overrides[i]))
            log.info(f"\t#{initial_job_idx + i} : {point} -> slurm job {job.job_id}, {dict(request)}")
            jobs[job] = i

    for job in _as_completed(list(jobs)):
        i = jobs[job]
        key = point_key(job_overrides[i])
        try:
            if hasattr(job, "parakit_state"):  # ended without a result: results() would wait for ever
                raise RuntimeError(_log_tail(job))
            result = job.results()[0]  # the Hydra job's JobReturn, pickled back by submitit
        except Exception as e:  # the Slurm job died before the point recorded itself
            state = getattr(job, "parakit_state", None) or str(job.state)
            status = "timed_out" if "TIMEOUT" in state else "failed"
            tail = "\n".join(str(e).splitlines()[-15:])
            record(sweep_dir, _failed_row(key, status, f"slurm job {job.job_id} ({state}): {tail}"))
            report(i, 0, _row(sweep_dir, key), job.job_id)
            continue
        if result.status != JobStatus.COMPLETED:  # the task raised: Hydra's sweeper reports it
            returns[i] = result
            finished += 1
            continue
        report(i, result.return_value, _row(sweep_dir, key), job.job_id)
        returns[i] = result
    return returns


# Slurm states of a job that ended (squeue/scontrol JobState).
ENDED = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _scontrol_state(job_id: str) -> str | None:
    """The job's state from slurmctld (it keeps ended jobs for MinJobAge, 300 s by default); None
    when it no longer knows the job."""
    import re
    import subprocess

    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    found = re.search(r"JobState=(\S+)", out.stdout) if out.returncode == 0 else None
    return found.group(1) if found else None


def _log_tail(job, lines: int = 15) -> str:
    """The last lines of the job's stderr and stdout (submitit's log files), or what is missing."""
    text = []
    for path in (job.paths.stderr, job.paths.stdout):
        if path.exists():
            text += path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or f"no output in {job.paths.folder}: the batch script ended before the job ran"


def _as_completed(jobs: list, poll_s: float = 2.0):
    """submitit's jobs as they end. submitit reads job states from sacct only: on a cluster without
    accounting a job that died before writing its result (a failing batch script, a killed node) is
    never done for it, so an ended job is also recognised by scontrol's state, and a job slurmctld
    has forgotten without a result is taken as ended."""
    pending = list(jobs)
    while pending:
        for job in list(pending):
            if job.done():
                pending.remove(job)
                yield job
                continue
            state = job.state if job.state != "UNKNOWN" else _scontrol_state(job.job_id)
            if state is None or state.split()[0] in ENDED:
                time.sleep(poll_s)  # the result file is written before the job ends: one more look
                if not job.done():
                    job.parakit_state = state or "ENDED (forgotten by slurmctld)"
                pending.remove(job)
                yield job
        if pending:
            time.sleep(poll_s)


def _row(sweep_dir: Path, key: str) -> dict | None:
    """The point's row in sweep.json (None: the job recorded none)."""
    return next((r for r in read_rows(sweep_dir) if r["point"] == key), None)
