"""Fault detection and injection: a progress watchdog that names the stuck rank, and the
injected faults of `train.fault.*` (first attempt only, so that a restarted job runs through).

The watchdog: every rank publishes a progress counter (micro-batches done) in torch.distributed's
key-value store; a thread on each rank wakes up regularly and, when its own counter has not moved
for `watchdog_timeout_s`, reads every rank's counter, names the ranks furthest behind (those
stuck in compute; the others wait for them in a collective), and ends this process so that
torchrun tears the job down and restarts it instead of hanging until the collective timeout.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

import torch

from toolkit.config.schema import FaultConfig
from toolkit.train.distributed import end_helper_processes, job_restarts


def _exit(code: int) -> None:
    """Die at once, like a crashed rank, without leaving helper processes behind."""
    end_helper_processes()
    os._exit(code)


def first_attempt() -> bool:
    """The job's first attempt, the same answer on every rank (an injected fault fires once)."""
    return job_restarts() == 0


class Watchdog:
    def __init__(self, timeout_s: float | None):
        self.rank = torch.distributed.get_rank()
        self.world = torch.distributed.get_world_size()
        self.timeout = timeout_s
        self.progress = 0
        self.step = 0
        self._moved = time.monotonic()
        self._suspended = False
        self._store = torch.distributed.distributed_c10d._get_default_store() if timeout_s else None
        if timeout_s:
            self._publish()
            threading.Thread(target=self._watch, name="parakit-watchdog", daemon=True).start()

    def _publish(self) -> None:
        self._store.set(f"parakit/progress/{self.rank}", f"{self.progress} {self.step}")

    def beat(self, step: int) -> None:
        """Called after each unit of work (a micro-batch) of `step`."""
        self.progress += 1
        self.step = step
        self._moved = time.monotonic()
        if self._store is not None:
            self._publish()

    @contextlib.contextmanager
    def suspended(self):
        """Checkpoint I/O is not compute: a long save must not look like a stuck rank (a hung
        filesystem still ends in the collective timeout)."""
        self._suspended = True
        try:
            yield
        finally:
            self._moved = time.monotonic()
            self._suspended = False

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            idle = time.monotonic() - self._moved
            if idle < self.timeout or self._suspended:
                continue
            counts = {}
            for rank in range(self.world):
                try:
                    progress, step = self._store.get(f"parakit/progress/{rank}").decode().split()
                    counts[rank] = (int(progress), int(step))
                except Exception:  # the store went away with rank 0: nothing left to compare
                    counts[rank] = (-1, -1)
            behind = min(c[0] for c in counts.values())
            stuck = [r for r, c in counts.items() if c[0] == behind]
            print(
                f"watchdog (rank {self.rank}): no progress for {idle:.0f} s; rank(s) {stuck} stuck at step "
                f"{counts[stuck[0]][1] + 1} (progress {behind}, the others at "
                f"{max(c[0] for c in counts.values())}); ending the job so that it restarts",
                file=sys.stderr,
                flush=True,
            )
            _exit(3)


def inject_step_faults(fault: FaultConfig, step: int) -> None:
    """Kill, stall or run this rank out of memory at the start of `step`, when asked to."""
    if not first_attempt():
        return
    rank = torch.distributed.get_rank()
    if fault.kill_rank == rank and fault.kill_at_step == step:
        print(f"fault injection: killing rank {rank} at step {step}", file=sys.stderr, flush=True)
        _exit(1)
    if fault.stall_rank == rank and fault.stall_at_step == step:
        print(
            f"fault injection: stalling rank {rank} at step {step} for {fault.stall_seconds:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(fault.stall_seconds)
    if fault.oom_rank == rank and fault.oom_at_step == step:
        # torch.OutOfMemoryError is what CUDA's caching allocator raises (c10/cuda/CUDACachingAllocator.cpp)
        raise torch.OutOfMemoryError(f"fault injection: CUDA out of memory on rank {rank} at step {step}")


def slow_down(fault: FaultConfig, timers) -> None:
    """train.fault.slow_rank computes fault.slow_seconds longer at every step: a sleep counted as its
    compute (`timers`: the step's ComputeTimers), as a slow GPU or a throttled node would show."""
    if fault.slow_rank == torch.distributed.get_rank():
        with timers.timing():
            time.sleep(fault.slow_seconds)


def corrupt(directory: Path) -> None:
    """Damage the largest file of a published checkpoint (flip bytes in place)."""
    target = max(
        (p for p in directory.rglob("*") if p.is_file() and p.name != "manifest.json"), key=lambda p: p.stat().st_size
    )
    with open(target, "r+b") as f:
        f.seek(target.stat().st_size // 2)
        f.write(b"\xde\xad\xbe\xef")
    print(f"fault injection: corrupted {target}", file=sys.stderr, flush=True)
