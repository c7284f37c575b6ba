"""Training on your own data, end to end: a 4 MB jsonl corpus, a tokenizer that is not GPT-2 with
76,000 tokens, prepared by `parakit data prepare` (tests/conftest.py prepared_corpus), trained
with a validation loss that falls, and resumed after a rank dies (torchrun restarts the job from
the newest checkpoint); the DeepSpeed backend trains on it in tests/test_train_deepspeed.py. The
run logs to TensorBoard, W&B (offline) and MLflow (its SQLite store), read back here.

On megatron rank 1 dies at the start of step 12, torchrun restarts the
ranks, they resume from the step-8 checkpoint and finish. Both attempts print every step's loss, so steps
9-11 are seen twice: the same data order and random state give the same losses (printed to 4
decimals; a shifted sample order or a lost optimizer state changes them by 1e-2 or more).
"""

from __future__ import annotations

import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tracker_logs import mlflow_runs, tensorboard_scalars, wandb_runs
from training_runs import Trained, run

pytestmark = pytest.mark.slow

STEPS, EVAL_EVERY, SAVE_EVERY, KILL_AT = 16, 4, 8, 12


def common(prefix) -> list[str]:
    return [
        "cluster.gpus_per_node=2",
        f"data.path={prefix}",
        "model.vocab_size=76000",
        "model.seq_length=64",
        f"train.steps={STEPS}",
        "train.global_batch=8",
        "train.micro_batch=2",
        f"train.eval_interval={EVAL_EVERY}",
        "train.eval_iters=2",
        "train.log_interval=1",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
    ]


# megatron also loses a rank at step 12 and resumes from its step-8 checkpoint. The DeepSpeed
# backend trains on the same prepared corpus in tests/test_train_deepspeed.py (ZeRO-3), and its
# resume is tested on the bundled corpus (tests/test_faults_deepspeed.py).
KILLED = [
    f"checkpoint.interval_steps={SAVE_EVERY}",
    "train.fault.kill_rank=1",
    f"train.fault.kill_at_step={KILL_AT}",
    "train.fault.max_restarts=1",
]


def test_own_corpus_trains_on_megatron_with_falling_validation_loss_and_resumes(tmp_path, prepared_corpus):
    loggers = "train.loggers=[tensorboard,wandb,mlflow]"  # metrics.jsonl is written in any case
    result = run(tmp_path, "megatron", *common(prepared_corpus), "parallel.tp=2", *KILLED, loggers)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    trained = Trained(result.run_dir)
    assert "data: corpus (" in result.stdout and "tokenizer " in result.stdout and "vocab 76,000" in result.stdout
    assert_resumed_exactly(trained, result.stdout)
    assert_validation_falls(trained, result.run_dir)
    assert_trackers_have_metrics_jsonl(trained, result.run_dir)


def assert_validation_falls(trained: Trained, run_dir) -> None:
    """Every EVAL_EVERY steps and after the last, falling, in metrics.jsonl, TensorBoard and result.json."""
    evaluations = trained.evaluations
    assert [r["step"] for r in evaluations] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    val = [r["val_loss"] for r in evaluations]
    assert all(later < earlier for earlier, later in zip(val, val[1:])), val
    assert val[0] < 11.3 and val[-1] < val[0] - 0.7, val  # from ln(76000) = 11.24: it learns
    assert trained.result["final_val_loss"] == val[-1]
    board = EventAccumulator(str(run_dir / "tensorboard"))
    board.Reload()
    logged = {e.step: e.value for e in board.Scalars("val/loss")}
    assert sorted(logged) == [r["step"] for r in evaluations]
    assert all(abs(logged[r["step"]] - r["val_loss"]) < 1e-5 for r in evaluations)
    assert [r["step"] for r in trained.records] == list(range(1, STEPS + 1))


SCALARS = {
    "train/loss": "loss",
    "train/lr": "lr",
    "train/grad_norm": "grad_norm",
    "train/step_time_s": "step_time_s",
    "train/tokens_per_s": "tokens_per_s",
    "train/mfu": "mfu",
    "train/memory_gib": "memory_gib",
    "planner/step_time_s": "predicted_step_time_s",
    "planner/memory_gib": "predicted_memory_gib",
}


def assert_trackers_have_metrics_jsonl(trained: Trained, run_dir) -> None:
    """TensorBoard, W&B and MLflow hold metrics.jsonl's values under the same names: the first
    attempt's W&B and MLflow runs up to the checkpoint it resumed from (at least), the resumed
    attempt's runs from there on; TensorBoard's one log, every step (a repeated step replaces)."""
    steps = {r["step"]: r for r in trained.records}
    validation = {r["step"]: r["val_loss"] for r in trained.evaluations}
    board = tensorboard_scalars(run_dir)
    for name, key in SCALARS.items():
        assert board[name] == pytest.approx({s: r[key] for s, r in steps.items()}, rel=1e-6), name  # float32
    assert board["val/loss"] == pytest.approx(validation, rel=1e-6)
    name = run_dir.name
    for tracker, runs in [("wandb", wandb_runs(run_dir)), ("mlflow", mlflow_runs(run_dir))]:
        assert list(runs) == [name, f"{name}-from-step-{SAVE_EVERY}"], (tracker, list(runs))
        first, resumed = (runs[n]["scalars"] for n in runs)
        for scalar, key in SCALARS.items():
            assert resumed[scalar] == {s: r[key] for s, r in steps.items() if s > SAVE_EVERY}, (tracker, scalar)
            kept = {s: v for s, v in first[scalar].items() if s <= SAVE_EVERY}
            assert kept == {s: r[key] for s, r in steps.items() if s <= SAVE_EVERY}, (tracker, scalar)
        assert {**first["val/loss"], **resumed["val/loss"]} == validation, tracker
    params = mlflow_runs(run_dir)[name]["params"]
    assert params["train.steps"] == str(STEPS) and params["parallel.tp"] == "2", params
    assert wandb_runs(run_dir)[name]["params"]["train"]["eval_interval"] == EVAL_EVERY


def assert_resumed_exactly(trained: Trained, stdout: str) -> None:
    """Resumed once, from the step-8 checkpoint, after the kill at step 12: steps 9-11 were printed
    by both attempts, with the same losses."""
    assert trained.result["restarts"] == 1 and trained.result["resumed_step"] == SAVE_EVERY
    printed = {}
    for step, loss in re.findall(r"^step +(\d+)/\d+ \| loss ([\d.]+)", stdout, re.M):
        printed.setdefault(int(step), []).append(float(loss))
    for step in range(SAVE_EVERY + 1, KILL_AT):
        first, again = printed[step]
        assert abs(first - again) <= 1e-4, f"step {step}: {first} before the kill, {again} after resuming"
