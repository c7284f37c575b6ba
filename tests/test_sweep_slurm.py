"""`parakit sweep` on a real Slurm cluster: each point is a Slurm job (hydra/launcher=slurm, through
hydra-submitit-launcher) asking for what its ranks need, trained inside its allocation and recorded
in the sweep directory; a re-run submits nothing for recorded points.

The cluster: the session's `slurm_env` (tests/slurm_cluster.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from slurm_cluster import ended_job, job

from toolkit.report.sweep_slurm import resources

SHORT = ["data=synthetic", "train.steps=3", "train.global_batch=4", "model.num_layers=2", "--warmup-steps", "1"]
GRID = ["backend=megatron", "cluster.gpus_per_node=1,2"]


def sweep(directory: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "toolkit.cli", "sweep", *args, f"hydra.sweep.dir={directory}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=directory.parent, env=env)


@pytest.mark.slow
def test_sweep_points_run_as_slurm_jobs_and_a_rerun_submits_nothing(slurm_env, tmp_path):
    directory = tmp_path / "sweep"
    slurm = ["hydra/launcher=slurm", "hydra.launcher.partition=debug", "hydra.launcher.timeout_min=10"]
    first = sweep(directory, slurm_env, *SHORT, *GRID, *slurm)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    rows = {r["world_size"]: r for r in json.loads((directory / "sweep.json").read_text())["points"]}
    assert set(rows) == {1, 2}
    for r in rows.values():
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["step_time_s"] > 0, r
        assert (Path(r["run_dir"]) / "metrics.jsonl").exists()
    assert len((directory / "sweep.csv").read_text().splitlines()) == 3  # header + both points

    # Progress came back here as the jobs finished; each point was its own Slurm job, which ran the
    # Hydra job (its log has the point's line) with a CPU per rank and no GPU.
    job_ids = re.findall(r"\[slurm job (\S+)\]", first.stdout)
    assert len(job_ids) == 2 and "sweep point 2/2" in first.stdout, first.stdout
    for job_id in job_ids:
        logs = list((directory / ".submitit").glob(f"{job_id}*/*_0_log.out"))
        assert logs and "sweep point" in logs[0].read_text(), job_id
        ended = ended_job(job_id, slurm_env)
        if ended:  # slurmctld forgets finished jobs after MinJobAge (300 s)
            assert ended["JobState"] == "COMPLETED" and ended["Partition"] == "debug", ended
            assert "gpu" not in ended.get("TRES", ""), ended
    cpus = sorted(int(job(j, slurm_env).get("NumCPUs", 0)) for j in job_ids)
    assert cpus in ([1, 2], [0, 0]), cpus

    submitted = sorted((directory / ".submitit").iterdir())
    again = sweep(directory, slurm_env, *SHORT, *GRID, *slurm)
    assert again.returncode == 0 and again.stdout.count("skipped (recorded before)") == 2, again.stdout[-2000:]
    assert sorted((directory / ".submitit").iterdir()) == submitted and "slurm job" not in again.stdout


@pytest.mark.slow
def test_plain_submitit_slurm_runs_the_points_too(slurm_env, tmp_path):
    """Hydra's own launcher, with the resources given as hydra.launcher.* overrides."""
    directory = tmp_path / "plain"
    launcher = ["hydra/launcher=submitit_slurm", "hydra.launcher.partition=debug", "hydra.launcher.cpus_per_task=1"]
    done = sweep(directory, slurm_env, *SHORT, "cluster.gpus_per_node=1", *launcher)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (row,) = json.loads((directory / "sweep.json").read_text())["points"]
    assert row["status"] == "ok" and row["tokens_per_s"] > 0, row
    (log,) = (directory / ".submitit").glob("*/*_0_log.out")  # the Slurm job's output: the point's line
    assert "sweep point 1 [" in log.read_text()


@pytest.mark.slow
def test_a_point_whose_slurm_job_dies_is_recorded_as_failed_and_the_sweep_goes_on(slurm_env, tmp_path):
    """The batch script exits before the Hydra job starts (submitit's setup lines run first), as
    when a node fails or Slurm kills the job: no row from the job, so the launcher records one."""
    directory = tmp_path / "dies"
    slurm = ["hydra/launcher=slurm", "hydra.launcher.partition=debug", "hydra.launcher.setup=[exit 3]"]
    done = sweep(directory, slurm_env, *SHORT, "cluster.gpus_per_node=1", *slurm)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (row,) = json.loads((directory / "sweep.json").read_text())["points"]
    assert row["status"] == "failed" and re.match(r"slurm job \S+ \(FAILED\)", row["error"]), row
    assert "sweep point 1/1" in done.stdout and "failed" in done.stdout


def test_each_point_asks_for_a_cpu_per_rank_on_cpu_clusters_and_a_gpu_per_rank_on_gpu_clusters():
    cpu = OmegaConf.create({"cluster": {"device": "cpu", "nodes": 1, "gpus_per_node": 2}})
    gpu = OmegaConf.create({"cluster": {"device": "cuda", "nodes": 1, "gpus_per_node": 8}})
    assert resources(cpu, {}) == {"nodes": 1, "tasks_per_node": 1, "cpus_per_task": 2}  # never a GPU
    assert resources(gpu, {}) == {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 8}
    assert resources(gpu, {"gpus_per_node": 4, "cpus_per_task": 6}) == {"nodes": 1, "tasks_per_node": 1}


def test_slurm_without_sbatch_is_refused_naming_the_fix(monkeypatch, capsys):
    from toolkit.cli import main

    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["sweep", "hydra/launcher=slurm", "data=synthetic"]) == 1
    err = capsys.readouterr().err
    assert "hydra/launcher=slurm submits each point with sbatch, which is not on PATH" in err
    assert "drop hydra/launcher" in err
