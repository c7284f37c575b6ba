"""Training steps under torch.profiler: train.profile_step_start up to train.profile_step_end
(exclusive, as Megatron-LM's --profile-step-start / --profile-step-end), on rank 0.

<run dir>/profile/ gets rank0_trace.json.gz, a Chrome trace to open in Perfetto (ui.perfetto.dev)
or chrome://tracing, and summary.json: for each profiled step its wall time, the host's operators
and, on a GPU, how long kernels kept the device busy (by kind) and how long it sat idle. The split
tells a slow step's cause: a busy device runs slow kernels; an idle one waits for the host (Python,
the dispatcher, launches), which short kernels expose.
"""

from __future__ import annotations

import contextlib
import gzip
import json
from pathlib import Path

import torch

from toolkit.formats.atomic import write_atomic

STEP_MARK = "parakit step "  # the record_function name of a profiled step
TRACE, SUMMARY = "rank0_trace.json.gz", "summary.json"
DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")  # Kineto's categories of device work
# Kernel kinds by name, the first match wins (NCCL's kernels are ncclDevKernel_*; FlashAttention's,
# cuDNN's and torch's memory-efficient attention carry flash/fmha/attention; cuBLAS's and CUTLASS's
# GEMMs gemm, cutlass, nvjet, xmma).
KINDS = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas")),
)


def kernel_kind(event: dict) -> str:
    if event.get("cat") != "kernel":
        return "memory"  # copies and memsets
    name = event["name"].lower()
    return next((kind for kind, marks in KINDS if any(m in name for m in marks)), "other")


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _top_level(ops: list[dict]) -> list[dict]:
    """The operators no other operator of their thread encloses (what the host dispatched)."""
    top, ends = [], {}
    for op in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        if op["ts"] >= ends.get(op["tid"], float("-inf")):
            top.append(op)
            ends[op["tid"]] = op["ts"] + op["dur"]
    return top


def summarize(events: list[dict]) -> list[dict]:
    """Each profiled step of a Chrome trace's `traceEvents` (times in microseconds): wall seconds,
    host operators, and where device events were recorded the device's busy and idle seconds,
    kernel launches and kernel seconds by kind."""
    spans = [e for e in events if e.get("ph") == "X"]
    steps = sorted((e for e in spans if e.get("name", "").startswith(STEP_MARK)), key=lambda e: e["ts"])
    device = [e for e in spans if e.get("cat") in DEVICE_EVENTS]
    ops = [e for e in spans if e.get("cat") == "cpu_op"]
    launches = [e for e in spans if e.get("cat") == "cuda_runtime" and "LaunchKernel" in e.get("name", "")]
    out = []
    for mark in steps:
        start, end = mark["ts"], mark["ts"] + mark["dur"]
        record = {
            "step": int(mark["name"].removeprefix(STEP_MARK)),
            "wall_s": mark["dur"] / 1e6,
            "host_ops": len(_top_level([o for o in ops if start <= o["ts"] < end])),
        }
        if device:
            inside = [e for e in device if start <= e["ts"] < end]
            busy = _covered([(e["ts"], min(e["ts"] + e["dur"], end)) for e in inside]) / 1e6
            kinds: dict[str, float] = {}
            for e in inside:
                kinds[kernel_kind(e)] = kinds.get(kernel_kind(e), 0.0) + e["dur"] / 1e6
            record |= {
                "device_busy_s": busy,
                "device_idle_s": record["wall_s"] - busy,
                "kernel_launches": sum(start <= e["ts"] < end for e in launches),
                "kernel_s": dict(sorted(kinds.items())),
            }
        out.append(record)
    return out


def describe(summary: list[dict]) -> str:
    """One line per profiled step."""
    lines = []
    for s in summary:
        line = f"step {s['step']}: {s['wall_s']:.4g} s, {s['host_ops']} host ops"
        if "device_busy_s" in s:
            kinds = ", ".join(f"{k} {v:.3g} s" for k, v in s["kernel_s"].items())
            line += (
                f", {s['kernel_launches']} kernels; device busy {s['device_busy_s'] / s['wall_s']:.0%}"
                f" ({kinds}), idle {s['device_idle_s']:.3g} s"
            )
        lines.append(line)
    return "\n".join(lines)


class StepProfiler:
    """`with profiler.step(n):` around each training step; records the steps of the window."""

    def __init__(self, train_cfg, run_dir: Path, enabled: bool):
        start = train_cfg.profile_step_start
        self.window = range(start, train_cfg.profile_step_end or start + 1) if start is not None else range(0)
        self.enabled, self.dir = enabled and bool(self.window), run_dir / "profile"
        self._profiler = None

    @contextlib.contextmanager
    def step(self, step: int):
        if not self.enabled or step not in self.window:
            yield
            return
        if self._profiler is None:
            from torch.profiler import ProfilerActivity, profile

            cuda = torch.cuda.is_available()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            self._profiler = profile(activities=activities)
            self._profiler.start()
        with torch.profiler.record_function(f"{STEP_MARK}{step}"):
            yield
            if torch.cuda.is_available():  # the step's kernels end inside its mark
                torch.cuda.synchronize()
        if step == self.window[-1]:
            self.close()

    def close(self) -> None:
        """Stop and write the trace and summary (also for a run that ends inside the window)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / TRACE
        profiler.export_chrome_trace(str(trace))
        with gzip.open(trace, "rt") as f:
            summary = summarize(json.load(f)["traceEvents"])
        write_atomic(self.dir / SUMMARY, json.dumps(summary, indent=1) + "\n")
        print(f"profile: {self.dir} ({TRACE}: open in ui.perfetto.dev)\n" + describe(summary), flush=True)
