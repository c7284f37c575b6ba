"""The one prepared GPU script, run as its dry run on CPU (`scripts/gpu_check.sh --cpu`): the same
steps, commands and JSON as on the first GPU, at toy size, so that it cannot rot before a GPU
machine is at hand. Its figures are checked against what the runs themselves recorded."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from training_runs import python

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_processes_left_behind")]


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--cpu", "--out", str(out), "--python", python()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + (out / "gpu_check.log").read_text()[-4000:]
    return out, json.loads((out / "gpu_check.json").read_text())["steps"]


def test_every_step_ran_and_the_environment_is_this_machines(checked):
    _, steps = checked
    assert list(steps) == [
        "environment",
        "megatron",
        "deepspeed_zero1",
        "deepspeed_zero3",
        "bench_overhead",
        "fused_adam_build",
    ]
    assert all(step["status"] == "ok" for step in steps.values()), steps
    environment = steps["environment"]
    assert environment["torch"] == torch.__version__ and environment["gpu"] is None
    assert environment["imports"]["transformer_engine.pytorch"] is False
    assert steps["megatron"]["kernels"]["transformer_engine"] is False  # megatron-core's HAVE_TE
    assert steps["fused_adam_build"]["skipped"].startswith("no CUDA device")


def test_the_megatron_run_resumes_at_its_checkpoint_to_the_same_curve(checked):
    out, steps = checked
    megatron = steps["megatron"]
    assert megatron["resume_max_loss_difference"] == 0.0 and megatron["resumed_at_step"] == 2
    resumed = [json.loads(line) for line in (out / "megatron_resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [3, 4]  # from step 2's checkpoint: the run's step 4 one was removed
    assert "step_00000002 at step 2" in (out / "gpu_check.log").read_text()


@pytest.mark.parametrize("name", ["megatron", "deepspeed_zero1", "deepspeed_zero3"])
def test_each_run_reports_measured_beside_predicted_from_its_own_records(checked, name):
    out, steps = checked
    step = steps[name]
    run_dir = out / ("megatron_whole" if name == "megatron" else name)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert step["steps"] == len(records) == 4 and step["timed_steps"] == 3
    timed = sorted(r["step_time_s"] for r in records[1:])
    assert step["step_time_s"] == timed[1]  # the median after the warm-up step
    assert step["predicted_step_time_s"] == records[-1]["predicted_step_time_s"]
    assert step["predicted_tokens_per_s"] == pytest.approx(
        step["tokens_per_s"] * step["step_time_s"] / step["predicted_step_time_s"]
    )
    assert step["memory_allocated_gib"] == max(r["memory_gib"] for r in records)
    assert step["predicted_tensors_gib"] == records[-1]["predicted_memory_gib"]
    assert step["kernels"]["adam"] == "torch.optim.adamw.AdamW"


def test_bench_overhead_compared_the_same_work(checked):
    _, steps = checked
    bench = steps["bench_overhead"]
    assert bench["max_loss_difference"] == 0.0 and bench["parakit_s"] > 0 and bench["bare_s"] > 0
