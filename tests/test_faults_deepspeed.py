"""Long runs that finish (deepspeed backend, CPU): exact resume, restart after a killed rank,
NaN losses (stop, or skip through DeepSpeed's overflow check), and the save interval by the
planner's rule."""
import pytest

import training_runs
from toolkit.train import checkpoint as ckpt
from training_runs import AUTO_INTERVAL, check_planned_interval, losses, records

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_processes_left_behind")]

COMMON = ["model=tiny", "backend=deepspeed", "data=synthetic", "precision=fp32", "train.steps=6", "train.global_batch=8",
          "train.micro_batch=2", "optim.lr=1e-3", "optim.warmup_steps=1", "cluster.gpus_per_node=2",
          "checkpoint.interval_steps=2", "train.fault.watchdog_timeout_s=120"]
LAYOUTS = {"zero3": ["zero=3"], "pipeline": ["parallel.pp=2", "zero=1"]}


def run(tmp_path, name, *overrides, timeout=600):
    return training_runs.run(tmp_path, name, *COMMON, *overrides, timeout=timeout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    return {name: losses(run(tmp, name, *layout)) for name, layout in LAYOUTS.items()}


def test_stopped_pipeline_run_resumes_exactly(tmp_path, uninterrupted):
    stopped = run(tmp_path, "run", *LAYOUTS["pipeline"], "train.fault.kill_rank=1", "train.fault.kill_at_step=5")
    assert stopped.returncode != 0 and not (stopped.run_dir / "result.json").exists()
    resumed = run(tmp_path, "run", *LAYOUTS["pipeline"])
    assert "resumed from" in resumed.stdout and "step_00000004" in resumed.stdout
    assert losses(resumed) == uninterrupted["pipeline"]  # bit for bit


def test_killed_rank_restarts_and_resumes_exactly(tmp_path, uninterrupted):
    """ZeRO-3: rank 1 dies at step 5, torchrun restarts both ranks, they resume from step 4."""
    result = run(tmp_path, "restart", *LAYOUTS["zero3"], "train.fault.kill_rank=1", "train.fault.kill_at_step=5",
                 "train.fault.max_restarts=1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "killing rank 1" in result.stderr and "resumed from" in result.stdout and "step_00000004" in result.stdout
    assert losses(result) == uninterrupted["zero3"]  # bit for bit


def test_nan_loss_stops_with_the_last_good_checkpoint(tmp_path):
    stopped = run(tmp_path, "stop", "zero=1", "train.fault.nan_at_step=3")
    assert stopped.returncode != 0 and "non-finite loss nan at step 3" in stopped.stderr
    assert not (stopped.run_dir / "result.json").exists()
    assert ckpt.find_resumable(stopped.run_dir / "checkpoints").name == "step_00000002"


def test_nan_loss_skips_the_update(tmp_path):
    """Rank 0's loss at step 3 is NaN: DeepSpeed drops that update on every rank (data parallel
    ZeRO-1 and the pipeline alike), the learning rate schedule does not advance, and both runs
    go on with the same losses."""
    curves = {}
    for name, layout in {"zero1_dp2": ["zero=1"], "pipeline": LAYOUTS["pipeline"]}.items():
        result = run(tmp_path, name, *layout, "train.fault.nan_at_step=3", "train.fault.nan_action=skip")
        steps = records(result)
        assert [r["skipped"] for r in steps] == [False, False, True, False, False, False], name
        assert steps[2]["lr"] == steps[1]["lr"] and steps[3]["lr"] > steps[2]["lr"]
        curves[name] = losses(result)
    assert curves["pipeline"][3:] == pytest.approx(curves["zero1_dp2"][3:], abs=1e-4)


def test_interval_by_the_planners_rule(tmp_path):
    result = run(tmp_path, "auto", "zero=3", *AUTO_INTERVAL)
    check_planned_interval(result, *COMMON, "zero=3", *AUTO_INTERVAL)
