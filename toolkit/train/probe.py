"""What each rank measures of itself, for sweeps and reports: the seconds it computes per step
(forward and backward, without waiting on other pipeline stages) and its peak memory -- the
allocator's peak on a GPU; on CPU the peak bytes held by tensors (torch.profiler's memory events,
when train.profile_memory is on) and the peak resident set size. Rank 0 gathers every rank's
figures into result.json: "ranks" and the pipeline's "stage_times_s" (the guide: judge a pipeline
by how even its stages are).
"""

from __future__ import annotations

import gc
import itertools
import os
import resource
import statistics
import time
from contextlib import contextmanager

import torch

from toolkit.plan.memory import GIB
from toolkit.train.distributed import local_restarts

# Start-up and the first steps (which allocate the optimizer state) are profiled: after them a
# step holds what every later step holds. Sweeps leave as many warm-up steps out of their timing.
PROFILED_STEPS = 2
COMPUTE = ("forward-compute", "backward-compute")  # megatron-core's schedule timers (level 2)


class _Span:
    """One timer: host seconds on CPU; on a GPU a pair of CUDA events on the current stream,
    read when the owner's seconds are asked for (once per step)."""

    def __init__(self, owner: ComputeTimers | None):
        self.owner, self.started = owner, None

    def start(self, barrier: bool = False) -> None:
        if self.owner:
            self.started = self.owner._mark()

    def stop(self, barrier: bool = False) -> None:
        if self.owner:
            self.owner._add(self.started, self.owner._mark())


class ComputeTimers:
    """Seconds of forward and backward compute since `reset`. It is the timers object megatron-core's
    schedules call (ModelParallelConfig.timers: `timers(name).start()/stop()`), counting only the
    compute timers; DeepSpeed layouts time their passes with `timing()`.

    On a GPU a span is two CUDA events recorded on the current stream, and `seconds` waits for the
    last one: nothing synchronises the device inside the step, so communication on other streams
    still overlaps the compute it would otherwise wait for, and only the compute stream's own time
    between the events counts (a synchronising timer at every micro-batch made parakit's
    throughput lower than the same run without it)."""

    def __init__(self):
        self._host = 0.0
        self._pending: list[tuple] = []  # (start, end) CUDA events not yet read
        self._compute, self._ignored = _Span(self), _Span(None)

    def __call__(self, name: str, log_level: int | None = None) -> _Span:
        return self._compute if name in COMPUTE else self._ignored

    @staticmethod
    def _mark():
        if torch.cuda.is_available():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _add(self, start, end) -> None:
        if isinstance(start, float):
            self._host += end - start
        else:
            self._pending.append((start, end))

    @property
    def seconds(self) -> float:
        if self._pending:
            self._pending[-1][1].synchronize()  # events complete in stream order
            self._host += sum(start.elapsed_time(end) for start, end in self._pending) / 1000  # ms
            self._pending = []
        return self._host

    @contextmanager
    def timing(self):
        started = self._mark()
        try:
            yield
        finally:
            self._add(started, self._mark())

    def reset(self) -> None:
        self._host, self._pending = 0.0, []


class MemoryProbe:
    """This rank's peak memory. On CPU with `profile_tensors`, torch.profiler records every
    allocation and free of the CPU allocator from start-up through step PROFILED_STEPS; the peak
    of their running sum is the most bytes tensors held at once (what the planner predicts; the
    resident set also holds the interpreter and the libraries)."""

    def __init__(self, profile_tensors: bool):
        self.tensor_peak_bytes: int | None = None
        self._profiler, self._steps = None, 0
        if profile_tensors and not torch.cuda.is_available():
            from torch.profiler import ProfilerActivity, profile

            os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no "profiler_start/stop" lines per rank in the log
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.start()
            gc.disable()

    def step_done(self) -> None:
        self._steps += 1  # steps of this process (a resumed run starts past step 1)
        if self._profiler is not None:
            gc.collect()
        if self._steps >= PROFILED_STEPS:
            self.close()

    def close(self) -> None:
        """Stop profiling (also for a run shorter than the profiled steps)."""
        if self._profiler is None:
            return
        self._profiler.stop()
        gc.enable()
        # kineto's events: the "[memory]" ones carry signed sizes (negative for a free)
        events = sorted(
            (e for e in self._profiler.profiler.kineto_results.events() if e.name() == "[memory]"),
            key=lambda e: e.start_ns(),
        )
        self.tensor_peak_bytes = max(itertools.accumulate(e.nbytes() for e in events), default=0)
        self._profiler = None

    def peaks(self) -> dict:
        if torch.cuda.is_available():
            return {
                "tensor_peak_gib": torch.cuda.max_memory_allocated() / GIB,
                "reserved_peak_gib": torch.cuda.max_memory_reserved() / GIB,
            }
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        tensors = self.tensor_peak_bytes
        return {"tensor_peak_gib": None if tensors is None else tensors / GIB, "peak_rss_gib": rss / GIB}


def gather_ranks(compute_s: list[float], memory: MemoryProbe, world_size: int, pp: int) -> list[dict] | None:
    """Every rank's figures, on rank 0 (None elsewhere): a collective, called by all ranks.
    Both backends put the pipeline outermost in the rank order (megatron-core's default order
    tp-cp-ep-dp-pp; DeepSpeed's PipeDataParallelTopology axes pipe, data): a rank's stage is
    rank // (world / pp)."""
    rank = torch.distributed.get_rank()
    mine = {
        "rank": rank,
        "stage": rank // (world_size // pp),
        "compute_s": compute_s,
        "restarts": local_restarts(),  # per node: each torchrun agent counts its own
        **memory.peaks(),
    }
    everyone = [None] * world_size if rank == 0 else None
    torch.distributed.gather_object(mine, everyone, dst=0)
    return everyone


def stage_times(ranks: list[dict], pp: int, skip_steps: int = PROFILED_STEPS) -> list[float]:
    """Seconds each pipeline stage computes per step: per step the stage's slowest rank, then the
    median over the steps after `skip_steps` (all steps when there are no more)."""
    times = []
    for stage in range(pp):
        per_step = [max(steps) for steps in zip(*(r["compute_s"] for r in ranks if r["stage"] == stage))]
        times.append(statistics.median(per_step[skip_steps:] or per_step) if per_step else 0.0)
    return times
