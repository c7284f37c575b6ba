"""An out-of-memory that explains itself: on a GPU the caching allocator's recent history is recorded
while the run trains (bounded: train.oom_history events, PyTorch's
torch.cuda.memory._record_memory_history, as torchtitan's memory snapshots do); when a rank runs out of
memory its snapshot is dumped into the run directory (RUN_DIR/oom/rankR.pickle, for
pytorch.org/memory_viz), and the report puts what the allocator held beside what the planner
predicted term by term, with the smallest change `validate` would offer for the memory the run
turned out to need."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from toolkit.config.schema import Config
from toolkit.plan.fit import BREAKDOWN, smallest_fitting_change
from toolkit.plan.layout import resolve
from toolkit.plan.memory import GIB, peak_memory

# CUDACachingAllocator's message (c10/cuda/CUDACachingAllocator.cpp): "Tried to allocate 2.00 GiB."
_REQUESTED = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def record_history(cfg: Config) -> None:
    """On a GPU, keep the allocator's last train.oom_history allocations and frees with their Python
    stacks (nothing on CPU, or with 0)."""
    if torch.cuda.is_available() and cfg.train.oom_history:
        torch.cuda.memory._record_memory_history(max_entries=cfg.train.oom_history, stacks="python")


def requested_bytes(message: str) -> float:
    """The allocation that failed, from the allocator's message (0 when it does not say)."""
    found = _REQUESTED.search(message)
    return float(found.group(1)) * _UNITS[found.group(2)] if found else 0.0


def report(cfg: Config, run_dir: Path, error: BaseException) -> str:
    """What ran out, what the allocator held, the planner's terms, the snapshot and a fix."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    layout = resolve(cfg)
    memory = peak_memory(cfg, layout)
    capacity = cfg.cluster.gpu_memory_gb * 1e9
    lines = [f"rank {rank} ran out of memory ({type(error).__name__}: {str(error).splitlines()[0]})"]
    needed = 0.0
    if torch.cuda.is_available():
        snapshot = Path(run_dir).absolute() / "oom" / f"rank{rank}.pickle"
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(snapshot))
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved()
        capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        requested = requested_bytes(str(error))
        needed = allocated + requested
        lines.append(
            f"  the allocator held at most {allocated / GIB:.2f} GiB of tensors, {reserved / GIB:.2f} GiB reserved, "
            f"of the device's {capacity / GIB:.2f} GiB; the failed request wanted {requested / GIB:.2f} GiB more"
        )
        lines.append(f"  the allocator's history and blocks: {snapshot} (open it at https://pytorch.org/memory_viz)")
    else:
        lines.append("  no CUDA allocator here: no snapshot")
    terms = ", ".join(f"{term} {getattr(memory, term) / GIB:.2f}" for term in BREAKDOWN)
    lines.append(
        f"  the planner predicted {memory.total / GIB:.2f} GiB on its busiest rank (pipeline stage {memory.stage}): "
        f"{terms} GiB"
    )
    lines.append("  Fix: " + _fix(cfg, memory.total, needed, capacity))
    return "\n".join(lines)


def _fix(cfg: Config, predicted: float, needed: float, capacity: float) -> str:
    """The first change (validate's order: ZeRO, recompute, micro-batch, tp, pp) whose predicted
    peak is lower than the planner's by as much as the run needed more than the device holds."""
    from toolkit.plan.validate import validate

    over = max(needed / capacity, 1.1) if needed else 1.1  # without figures: a tenth under today's prediction
    budget = dataclasses.replace(cfg.cluster, gpu_memory_gb=predicted / over / 1e9)
    change = smallest_fitting_change(
        dataclasses.replace(cfg, cluster=budget), lambda c: validate(c, data=False, memory=False).ok
    )
    if change is None:
        return "no change of one or two settings lowers the prediction enough: `parakit plan` searches every layout"
    return f"{change[0]} (the planner's peak {predicted / GIB:.1f} -> {change[1] / GIB:.1f} GiB)"
