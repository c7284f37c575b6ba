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
    (out / "stdout.txt").write_text(result.stdout)
    return out, json.loads((out / "gpu_check.json").read_text())["steps"]


def test_every_step_ran_and_the_environment_is_this_machines(checked):
    _, steps = checked
    assert list(steps) == [
        "environment",
        "probe",
        "megatron",
        "deepspeed_zero1",
        "deepspeed_zero3",
        "kernels",
        "out_of_memory",
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
    # the save's figures, and the limit the planner set from the probed filesystem's write speed
    assert megatron["save_gb"] > 0 and megatron["save_gbs"] > 0 and megatron["load_s"] > 0
    assert 0 <= megatron["save_peak_extra_gb"] < 1
    budget = json.loads((out / "gpu_check.json").read_text())["megatron_budget"]
    assert budget["cluster"] == "probed" and budget["predicted_save_s"] > 0 and budget["budget_s"] >= 120


@pytest.mark.parametrize("name", ["megatron", "deepspeed_zero1", "deepspeed_zero3"])
def test_each_run_reports_measured_beside_predicted_from_its_own_records(checked, name):
    out, steps = checked
    step = steps[name]
    run_dir = out / ("megatron_whole" if name == "megatron" else name)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert step["steps"] == len(records) == 4 and step["timed_steps"] == 2
    timed = [r["step_time_s"] for r in records[1:3]]  # after the warm-up step, before the profiled one
    assert step["step_time_s"] == pytest.approx(sum(timed) / 2)
    (profiled,) = step["profile"]  # step 4 under torch.profiler: its trace beside
    assert profiled["step"] == 4 and profiled["host_ops"] > 0 and profiled["wall_s"] > 0
    assert (run_dir / "profile" / "rank0_trace.json.gz").is_file()
    assert step["predicted_step_time_s"] == records[-1]["predicted_step_time_s"]
    assert step["predicted_tokens_per_s"] == pytest.approx(
        step["tokens_per_s"] * step["step_time_s"] / step["predicted_step_time_s"]
    )
    assert step["memory_allocated_gib"] == max(r["memory_gib"] for r in records)
    assert step["predicted_tensors_gib"] == records[-1]["predicted_memory_gib"]
    assert step["kernels"]["adam"] == "torch.optim.adamw.AdamW"
    assert 5 < step["console_lines_to_step_1"] < 40  # one screen (issue: the quiet console on the GPU)


def test_a_run_past_the_device_exits_1_with_the_report(checked):
    """On CPU the drill stands in for the allocator (no snapshot); on a GPU a real micro-batch of 64."""
    out, steps = checked
    oom = steps["out_of_memory"]
    ran_out, fix = oom["report"]
    assert ran_out.startswith("parakit train: rank 0 ran out of memory (OutOfMemoryError: ") and fix.startswith("Fix: ")
    assert oom["snapshot_bytes"] is None and not (out / "out_of_memory" / "result.json").exists()


def test_the_kernels_step_runs_each_backend_with_and_without_the_fused_kernels(checked):
    """On CPU train.kernels=auto resolves to the reference kernels: the two runs of a backend are the
    same computation, so their losses are equal; each run's summary names the kernels it used."""
    out, steps = checked
    kernels = steps["kernels"]
    for backend in ("megatron", "deepspeed"):
        assert kernels[f"{backend}_max_loss_difference"] == 0.0
        for choice in ("reference", "auto"):
            run = kernels[f"{backend}_{choice}"]
            records = [json.loads(line) for line in (out / f"kernels_{backend}_{choice}" / "metrics.jsonl").open()]
            assert run["steps"] == len(records) == 4 and run["mfu"] > 0 and run["memory_allocated_gib"] > 0
            assert "loss" in run["kernels"] and "layers" in run["kernels"]
    printed = (out / "stdout.txt").read_text()
    assert "gpu_check: kernels megatron: reference " in printed and "losses at most 0.00e+00 apart" in printed


def test_bench_overhead_compared_the_same_work(checked):
    _, steps = checked
    bench = steps["bench_overhead"]
    assert bench["max_loss_difference"] == 0.0 and bench["parakit_s"] > 0 and bench["bare_s"] > 0


def test_the_probe_wrote_a_cluster_file_and_each_run_is_predicted_on_it_and_on_its_datasheet(checked):
    """Each run's step time and memory beside the planner's on the cluster it ran with (on CPU the
    cpu cluster, its figures the cached probe's) and on the cluster file `parakit probe` wrote (the
    same figures here: the two predictions must agree), in the JSON and printed."""
    out, steps = checked
    probe = steps["probe"]
    assert probe["cluster_file"] == str(out / "probe" / "cluster" / "probed.yaml")
    assert probe["hbm_bandwidth_gbs"] > 0 and set(probe["stack"]) == {"megatron", "deepspeed"}
    printed = (out / "stdout.txt").read_text()
    for name in ("megatron", "deepspeed_zero1", "deepspeed_zero3"):
        step = steps[name]
        datasheet, probed = step["datasheet"], step["probed"]
        assert datasheet["cluster"] == "cpu" and probed["cluster"] == "probed"
        assert datasheet["step_time_s"] == pytest.approx(step["predicted_step_time_s"], rel=1e-9)
        assert datasheet["tensors_gib"] == pytest.approx(step["predicted_tensors_gib"], rel=1e-9)
        assert probed["step_time_s"] == pytest.approx(datasheet["step_time_s"], rel=1e-9)
        assert probed["tensors_gib"] == pytest.approx(datasheet["tensors_gib"], rel=1e-9)
        line = next(line for line in printed.splitlines() if line.startswith(f"gpu_check: {name}: step "))
        assert f"{step['step_time_s']:.3f} s measured; datasheet (cluster=cpu) {datasheet['step_time_s']:.3f} s" in line
        assert f"probed (cluster=probed) {probed['step_time_s']:.3f} s" in line
        assert any(row.startswith(f"gpu_check: {name} ") for row in printed.splitlines())  # the summary table


def test_only_runs_the_steps_named(tmp_path):
    result = subprocess.run(
        [python(), "scripts/gpu_check.py", "--cpu", "--out", str(tmp_path), "--only", "environment"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert list(json.loads((tmp_path / "gpu_check.json").read_text())["steps"]) == ["environment"]
    wrong = subprocess.run(
        [python(), "scripts/gpu_check.py", "--cpu", "--only", "environment,prob"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert wrong.returncode == 2 and "--only: no step prob" in wrong.stderr


def test_budget_skips_each_step_whose_limit_does_not_fit_and_runs_the_next_that_do(tmp_path):
    """On CPU the probe's limit is 300 s, the environment's 40 and fused_adam_build's 60: with 110 s
    the probe is skipped (recorded, with why) and fused_adam_build, after it, still runs; with 60 s
    it no longer fits once the environment has taken its seconds."""

    def check(budget: str, out: Path):
        result = subprocess.run(
            [python(), "scripts/gpu_check.py", "--cpu", "--out", str(out), "--budget", budget]
            + ["--only", "environment,probe,fused_adam_build"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout, json.loads((out / "gpu_check.json").read_text())["steps"]

    printed, steps = check("110", tmp_path / "a")
    assert steps["environment"]["status"] == "ok" and steps["fused_adam_build"]["status"] == "ok"
    assert steps["probe"] == {"status": "skipped", "reason": steps["probe"]["reason"]}
    assert "limit (300 s)" in steps["probe"]["reason"] and "--budget" in steps["probe"]["reason"]
    assert "skipped for --budget: probe" in printed
    printed, steps = check("60", tmp_path / "b")
    assert steps["environment"]["status"] == "ok" and steps["fused_adam_build"]["status"] == "skipped"
    assert "skipped for --budget: probe, fused_adam_build" in printed
    refused = subprocess.run(
        [python(), "scripts/gpu_check.py", "--cpu", "--budget", "0"], cwd=ROOT, capture_output=True, text=True
    )
    assert refused.returncode == 2 and "--budget: 0 s" in refused.stderr
