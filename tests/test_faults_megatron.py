"""Long runs that finish (megatron backend, CPU): exact resume, resume into another layout,
restart after a killed rank, corrupt and half-written checkpoints, a stalled rank, NaN losses,
asynchronous saves, and the save interval by the planner's rule (the schedule itself:
tests/test_save_schedule.py)."""
import shutil

import pytest

import training_runs
from toolkit.train import checkpoint as ckpt
from training_runs import AUTO_INTERVAL, check_planned_interval, losses, records

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_processes_left_behind")]

COMMON = ["model=tiny", "model.vocab_size=50688", "data=synthetic", "precision=fp32", "zero=1", "train.steps=6",
          "train.global_batch=8", "train.micro_batch=1", "optim.lr=1e-3", "optim.warmup_steps=1", "checkpoint.interval_steps=2",
          "train.fault.watchdog_timeout_s=120"]  # a rank that hangs ends the job instead of the test
TP2_PP2_VPP2 = ["cluster.gpus_per_node=4", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2"]
PP2 = ["cluster.gpus_per_node=2", "parallel.pp=2"]


def run(tmp_path, name, *overrides, timeout=600):
    return training_runs.run(tmp_path, name, *COMMON, *overrides, timeout=timeout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    return {"tp2_pp2_vpp2": losses(run(tmp, "a", *TP2_PP2_VPP2)), "pp2": losses(run(tmp, "b", *PP2))}


def test_stopped_run_resumes_exactly_and_into_another_layout(tmp_path, uninterrupted):
    """Rank 3 dies at the start of step 5 of a tp2 pp2 vpp2 run. Started again it resumes from
    step 4 bit for bit; a pp2 dp2 run pointed at the same checkpoints (dist_checkpointing
    resharding, distributed optimizer included) continues within 1e-6."""
    stopped = run(tmp_path, "run", *TP2_PP2_VPP2, "train.fault.kill_rank=3", "train.fault.kill_at_step=5")
    assert stopped.returncode != 0 and not (stopped.run_dir / "result.json").exists()
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(stopped.run_dir / "checkpoints", checkpoints)
    resumed = run(tmp_path, "run", *TP2_PP2_VPP2)
    assert "resumed from" in resumed.stdout and "step_00000004" in resumed.stdout
    assert losses(resumed) == uninterrupted["tp2_pp2_vpp2"]  # bit for bit
    moved = run(tmp_path, "pp2_dp2", "cluster.gpus_per_node=4", "parallel.pp=2", f"checkpoint.dir={checkpoints}")
    assert "resumed from" in moved.stdout
    # a new run directory: its curve starts after the checkpoint (steps 5 and 6)
    assert losses(moved) == pytest.approx(uninterrupted["tp2_pp2_vpp2"][4:], abs=1e-6)


def test_killed_rank_restarts_and_ends_with_the_uninterrupted_loss(tmp_path, uninterrupted):
    result = run(tmp_path, "restart", *PP2, "train.fault.kill_rank=1", "train.fault.kill_at_step=5", "train.fault.max_restarts=1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "killing rank 1" in result.stderr and "resumed from" in result.stdout and "step_00000004" in result.stdout
    assert losses(result) == uninterrupted["pp2"]  # the restarted ranks resume bit for bit


def test_corrupt_newest_checkpoint_is_detected_and_the_previous_one_used(tmp_path, uninterrupted):
    first = run(tmp_path, "run", *PP2, "train.fault.corrupt_checkpoint_at_step=4", "train.fault.kill_rank=0",
                "train.fault.kill_at_step=5")
    assert first.returncode != 0
    resumed = run(tmp_path, "run", *PP2)
    assert "step_00000004 is not usable" in resumed.stderr and "fails its checksum" in resumed.stderr
    assert "step_00000002" in resumed.stdout
    assert losses(resumed) == uninterrupted["pp2"]


def test_crash_during_save_leaves_no_checkpoint_marked_good(tmp_path):
    result = run(tmp_path, "run", *PP2, "train.fault.crash_in_save_at_step=4")
    assert result.returncode != 0
    root = result.run_dir / "checkpoints"
    assert (root / ckpt.LATEST).read_text().strip() == "step_00000002"
    assert (root / ".step_00000004.partial").exists() and not (root / "step_00000004").exists()
    assert ckpt.find_resumable(root) == root / "step_00000002"


def test_stalled_rank_is_detected_and_named_within_the_timeout(tmp_path):
    result = run(tmp_path, "stall", *PP2, "train.fault.stall_rank=1", "train.fault.stall_at_step=3",
                 "train.fault.stall_seconds=600", "train.fault.watchdog_timeout_s=15", timeout=300)
    assert result.returncode != 0
    assert "watchdog" in result.stderr and "rank(s) [1] stuck at step 3" in result.stderr
    assert result.seconds < 120


def test_nan_loss_stops_with_the_last_good_checkpoint_or_skips_the_step(tmp_path):
    stopped = run(tmp_path, "stop", *PP2, "train.fault.nan_at_step=3")
    assert stopped.returncode != 0 and "non-finite loss nan at step 3" in stopped.stderr
    assert not (stopped.run_dir / "result.json").exists()
    assert ckpt.find_resumable(stopped.run_dir / "checkpoints").name == "step_00000002"
    skipped = run(tmp_path, "skip", *PP2, "train.fault.nan_at_step=3", "train.fault.nan_action=skip")
    steps = records(skipped)
    assert [r["skipped"] for r in steps] == [False, False, True, False, False, False]
    assert steps[2]["lr"] == steps[1]["lr"] and steps[3]["lr"] != steps[2]["lr"]  # the schedule waited a step
    assert all(l == l for l in losses(skipped)[3:])  # finite again after the skipped step


def test_async_save_resumes_like_the_uninterrupted_run(tmp_path, uninterrupted):
    """The step-4 save is still in flight when rank 0 dies at the start of step 5: it is never
    published, and the run resumes from step 2 with the uninterrupted losses."""
    stopped = run(tmp_path, "run", *PP2, "checkpoint.async_save=true", "train.fault.kill_rank=0", "train.fault.kill_at_step=5")
    assert stopped.returncode != 0
    root = stopped.run_dir / "checkpoints"
    assert ckpt.find_resumable(root) == root / "step_00000002" and not (root / "step_00000004").exists()
    resumed = run(tmp_path, "run", *PP2, "checkpoint.async_save=true")
    assert "resumed from" in resumed.stdout and "step_00000002" in resumed.stdout
    assert losses(resumed) == uninterrupted["pp2"]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000004", "step_00000006"]
    assert all(ckpt.verify(p) is None for p in root.glob("step_*"))


def test_interval_by_the_planners_rule(tmp_path):
    result = run(tmp_path, "auto", *PP2, *AUTO_INTERVAL)
    check_planned_interval(result, *COMMON, *PP2, *AUTO_INTERVAL)
