"""train.profile_step_start/_end: the profiled steps' trace and summary (toolkit.train.step_profiler).
The whole loop with a profile runs in scripts/gpu_check.py's CPU dry run (tests/test_gpu_check.py)."""

import gzip
import json
from types import SimpleNamespace

import pytest
import torch

from toolkit.train import step_profiler
from toolkit.train.step_profiler import STEP_MARK, StepProfiler, summarize


def _span(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid}


# Two steps of a GPU trace (microseconds): step 7 from 1000 to 2000, step 8 from 3000 to 3500.
TRACE = [
    _span(f"{STEP_MARK}7", "user_annotation", 1000, 1000),
    _span("aten::linear", "cpu_op", 1010, 100),
    _span("aten::addmm", "cpu_op", 1020, 80),  # inside aten::linear: not a host op of its own
    _span("aten::add", "cpu_op", 1200, 10),
    _span("aten::mul", "cpu_op", 1300, 10, tid=2),  # the backward's thread
    _span("cudaLaunchKernel", "cuda_runtime", 1030, 5),
    _span("cudaLaunchKernel", "cuda_runtime", 1205, 5),
    _span("cuLaunchKernelEx", "cuda_runtime", 1305, 5),
    _span("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", 1100, 300),
    _span("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "kernel", 1300, 200),  # overlaps the first
    _span("cublasLt::splitKreduce_kernel", "kernel", 1350, 30),  # inside both
    _span("pytorch_flash::flash_fwd_kernel", "kernel", 1600, 100),
    _span("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "kernel", 1650, 100),  # overlaps the attention
    _span("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 1800, 50),
    _span("void at::native::vectorized_elementwise_kernel", "kernel", 1900, 200),  # runs past the mark
    _span(f"{STEP_MARK}8", "user_annotation", 3000, 500),
    _span("aten::add", "cpu_op", 3010, 10),
    _span("cudaLaunchKernel", "cuda_runtime", 3015, 5),
    _span("void at::native::vectorized_elementwise_kernel", "kernel", 3100, 100),
]


def test_summary_splits_each_step_into_busy_device_by_kind_and_idle():
    first, second = summarize(TRACE)
    assert first["step"] == 7 and first["wall_s"] == pytest.approx(1e-3)
    assert first["host_ops"] == 3  # linear (with its addmm), add, and mul on the other thread
    assert first["kernel_launches"] == 3
    # busy: 1100-1500, 1600-1750, 1800-1850, 1900-2000 (the last kernel clipped at the step's end)
    assert first["device_busy_s"] == pytest.approx(700e-6)
    assert first["device_idle_s"] == pytest.approx(300e-6)
    assert first["kernel_s"] == pytest.approx(
        {"attention": 100e-6, "communication": 100e-6, "gemm": 530e-6, "memory": 50e-6, "other": 200e-6}
    )
    assert second["step"] == 8 and second["device_busy_s"] == pytest.approx(100e-6)
    assert second["device_idle_s"] == pytest.approx(400e-6) and second["kernel_s"] == {"other": pytest.approx(1e-4)}


def test_a_cpu_trace_has_no_device_figures():
    (step,) = summarize([e for e in TRACE if e["cat"] in ("user_annotation", "cpu_op") and e["ts"] < 3000])
    assert set(step) == {"step", "wall_s", "host_ops"}


def _steps(profiler, steps):
    a = torch.randn(64, 64)
    for step in steps:
        with profiler.step(step):
            (a @ a).relu_().sum()


def test_the_window_is_profiled_and_written_on_cpu(tmp_path, capsys):
    profiler = StepProfiler(SimpleNamespace(profile_step_start=2, profile_step_end=4), tmp_path, enabled=True)
    _steps(profiler, range(1, 6))
    summary = json.loads((tmp_path / "profile" / "summary.json").read_text())
    assert [s["step"] for s in summary] == [2, 3]
    assert all(s["host_ops"] >= 3 and s["wall_s"] > 0 for s in summary)
    with gzip.open(tmp_path / "profile" / "rank0_trace.json.gz", "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"aten::mm", f"{STEP_MARK}2", f"{STEP_MARK}3"} <= names and f"{STEP_MARK}4" not in names
    assert "step 2:" in capsys.readouterr().out


def test_a_run_ending_inside_the_window_still_writes_it(tmp_path):
    profiler = StepProfiler(SimpleNamespace(profile_step_start=3, profile_step_end=10), tmp_path, enabled=True)
    _steps(profiler, range(1, 5))
    assert not (tmp_path / "profile").exists()
    profiler.close()  # what the loop does after its last step
    assert [s["step"] for s in json.loads((tmp_path / "profile" / "summary.json").read_text())] == [3, 4]


@pytest.mark.parametrize("start, enabled", [(None, True), (2, False)])
def test_no_window_or_another_rank_records_nothing(tmp_path, start, enabled):
    profiler = StepProfiler(SimpleNamespace(profile_step_start=start, profile_step_end=None), tmp_path, enabled)
    _steps(profiler, range(1, 4))
    profiler.close()
    assert not (tmp_path / "profile").exists()


def test_on_a_gpu_it_records_the_device_and_waits_for_each_steps_kernels(tmp_path, monkeypatch):
    """The CUDA branch, driven on CPU: the CUDA activity asked for, a synchronize ending each step."""
    asked, synchronized = [], []
    real = torch.profiler.profile

    def profile(activities):
        asked.extend(activities)
        return real(activities=[torch.profiler.ProfilerActivity.CPU])  # this machine records no kernels

    monkeypatch.setattr(torch.profiler, "profile", profile)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synchronized.append(True))
    profiler = StepProfiler(SimpleNamespace(profile_step_start=1, profile_step_end=3), tmp_path, enabled=True)
    _steps(profiler, range(1, 4))
    assert torch.profiler.ProfilerActivity.CUDA in asked
    assert len(synchronized) == 2
    assert step_profiler.kernel_kind({"cat": "gpu_memset", "name": "Memset"}) == "memory"
