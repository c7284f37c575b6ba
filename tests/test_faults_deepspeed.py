"""Long runs that finish (deepspeed backend, CPU), with dropout on (its random state restored): a
pipeline run stopped by a NaN loss resumes exactly, a killed ZeRO-3 rank restarts and resumes
exactly past a damaged checkpoint; NaN losses skipped through DeepSpeed's overflow check; a
resume into another ZeRO stage and dp size through a universal checkpoint. Which checkpoint a
run resumed from is read from its result.json."""

import pytest
import training_runs
from training_runs import (
    DEEPSPEED_SHORT,
    Tolerance,
    Trained,
    assert_same_training,
    losses,
    records,
)

from toolkit.config.store import load_run_config
from toolkit.train import checkpoint as ckpt

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_processes_left_behind")]

COMMON = [
    *DEEPSPEED_SHORT,
    "cluster.gpus_per_node=2",
    "checkpoint.interval_steps=2",
    "train.fault.watchdog_timeout_s=120",
]
DROPOUT = ["model.attention_dropout=0.1"]  # Llama-style transformers models have attention dropout only
LAYOUTS = {"zero3": ["zero=3", *DROPOUT], "pipeline": ["parallel.pp=2", "zero=1", *DROPOUT]}
EXACT = Tolerance(loss=0.0, grad_norm=0.0, parameters=0.0)


def run(tmp_path, name, *overrides, timeout=600):
    return training_runs.run(tmp_path, name, *COMMON, *overrides, timeout=timeout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    return {name: Trained(run(tmp, name, *layout).run_dir) for name, layout in LAYOUTS.items()}


def test_pipeline_run_stopped_by_a_nan_loss_resumes_exactly(tmp_path, uninterrupted):
    """A NaN loss at step 3 stops the pipeline run (nan_action=stop) with step 2 its newest
    checkpoint; started again, it resumes there exactly. (A killed rank: the ZeRO-3 restart below.)"""
    stopped = run(tmp_path, "run", *LAYOUTS["pipeline"], "train.fault.nan_at_step=3")
    assert stopped.returncode != 0 and "non-finite loss nan at step 3" in stopped.stderr, stopped.stderr[-3000:]
    assert not (stopped.run_dir / "result.json").exists()
    assert ckpt.find_resumable(stopped.run_dir / "checkpoints").name == "step_00000002"
    again = run(tmp_path, "run", *LAYOUTS["pipeline"])
    assert again.returncode == 0, again.stderr[-3000:]
    again = Trained(again.run_dir)
    assert again.result["resumed_from"].endswith("step_00000002") and again.result["resumed_step"] == 2
    assert_same_training(uninterrupted["pipeline"], again, EXACT)  # every step, and the final parameters


def test_killed_rank_restarts_and_resumes_exactly(tmp_path, uninterrupted):
    """ZeRO-3: rank 1 dies at step 3, torchrun restarts both ranks; step 2's checkpoint was damaged
    after it was published, so the engine loads it, its checksums fail, and the ranks load step 1
    over it and resume there exactly."""
    result = run(
        tmp_path,
        "restart",
        *LAYOUTS["zero3"],
        "checkpoint.interval_steps=1",
        "train.fault.corrupt_checkpoint_at_step=2",
        "train.fault.kill_rank=1",
        "train.fault.kill_at_step=3",
        "train.fault.max_restarts=1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    restarted = Trained(result.run_dir)
    assert restarted.result["restarts"] == 1 and restarted.result["resumed_from"].endswith("step_00000001")
    (unusable,) = restarted.result["unusable_checkpoints"]
    assert unusable["checkpoint"] == "step_00000002" and "fails its xxh3 checksum" in unusable["problem"]
    assert_same_training(uninterrupted["zero3"], restarted, EXACT)
    newest = ckpt.trainer_state(sorted(restarted.checkpoints.glob("step_*"))[-1])["model"]
    assert newest == ckpt.model_record(load_run_config(restarted.run_dir)) and newest["backend"] == "deepspeed"


def test_nan_loss_skips_the_update(tmp_path):
    """Rank 0's loss at step 3 is NaN: DeepSpeed drops that update on every rank (data parallel
    ZeRO-1 and the pipeline alike), the learning rate schedule does not advance, and both runs
    go on with the same losses."""
    curves = {}
    for name, layout in {"zero1_dp2": ["zero=1"], "pipeline": ["parallel.pp=2", "zero=1"]}.items():
        result = run(tmp_path, name, *layout, "train.fault.nan_at_step=3", "train.fault.nan_action=skip")
        steps = records(result)
        assert [r["skipped"] for r in steps] == [False, False, True, False], name
        assert steps[2]["lr"] == steps[1]["lr"] and steps[3]["lr"] != steps[2]["lr"]  # the schedule waited a step
        curves[name] = losses(result)
    assert curves["pipeline"][3:] == pytest.approx(curves["zero1_dp2"][3:], abs=1e-4)


# The planner's save interval is the shared loop's (toolkit.train.save_schedule, driven by
# toolkit.train.loop for every backend): tests/test_faults_megatron.py runs it once.


# fp32: the universal checkpoint carries the fp32 master weights and Adam moments exactly; only the
# order of the gradient sums changes with dp 2 -> 1 (measured: equal losses at steps 3-4). The
# defect to catch: Adam's moments lost on the way (cleared after the load: step 4's loss moves by
# 2.4e-4). ZeRO-3 checkpoints are not covered: ds_to_universal's ZeRO-3 output does not load here.
ANOTHER_LAYOUT = Tolerance(loss=1e-6, grad_norm=1e-5, parameters=1e-6)


def test_resume_into_another_zero_stage_and_dp_size_through_a_universal_checkpoint(tmp_path, deepspeed_zero1_dp2):
    """ZeRO-1 on 2 ranks saves step 2; ZeRO-2 on one rank (dp 2 -> 1, the same global batch)
    resumes from it through DeepSpeed's universal checkpoint: steps 3-4 and the final parameters
    as in the ZeRO-1 run."""
    import shutil

    reference = deepspeed_zero1_dp2
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(reference.checkpoints / "step_00000002", checkpoints / "step_00000002")
    (checkpoints / ckpt.LATEST).write_text("step_00000002\n")
    one = [o for o in COMMON if not o.startswith("cluster.gpus_per_node")] + ["cluster.gpus_per_node=1"]
    moved = training_runs.run(tmp_path, "moved", *one, "zero=2", f"checkpoint.dir={checkpoints}")
    assert moved.returncode == 0, moved.stderr[-3000:]
    assert "through a universal checkpoint" in moved.stdout, moved.stdout[-3000:]
    assert "dp 2 -> 1" in moved.stdout and "zero 1 -> 2" in moved.stdout
    # the conversion's own lines go to the log; DeepSpeed's notice about Megatron's mpu is dropped
    assert "Extracting ZeRO fragments" not in moved.stdout and "MPU is not provided" not in moved.stdout + moved.stderr
    moved = Trained(moved.run_dir)
    assert moved.result["resumed_step"] == 2
    assert_same_training(reference.after(2), moved, ANOTHER_LAYOUT)
