"""The slow rank, named while the run goes on: every train.fault.straggler_interval steps each rank's
mean compute seconds per step over the window are gathered on rank 0, and a rank slower than the
median of the other ranks doing the same work (its pipeline stage's) by more than
train.fault.straggler_threshold is reported with its host, local rank and stage (as
Megatron-LM's --log-straggler reports each rank's throughput against the others', and NVIDIA's
resiliency extension's straggler detection scores each rank against the median)."""

from __future__ import annotations

import os
import socket
import statistics

import torch

from toolkit.config.schema import FaultConfig
from toolkit.plan.layout import Layout


def slow_ranks(ranks: list[dict], threshold: float) -> list[dict]:
    """The ranks whose compute_s exceeds the median of the other ranks of their pipeline stage (the
    ranks doing the same work) by more than `threshold` (a fraction), each with that median and its
    excess, the slowest first. A stage of one rank has nothing to compare with."""
    stages: dict[int, list[dict]] = {}
    for rank in ranks:
        stages.setdefault(rank["stage"], []).append(rank)
    found = []
    for group in stages.values():
        for rank in group:
            others = [r["compute_s"] for r in group if r is not rank]
            median = statistics.median(others) if others else 0.0
            if median > 0 and rank["compute_s"] > median * (1 + threshold):
                found.append({**rank, "median_s": median, "over": rank["compute_s"] / median - 1})
    return sorted(found, key=lambda r: -r["over"])


class StragglerWatch:
    """Collects this rank's compute seconds per step; every `interval` steps a collective of all
    ranks (they reach it at the same step) returns, on rank 0, the slow ranks of the window."""

    def __init__(self, fault: FaultConfig, layout: Layout):
        self.interval, self.threshold = fault.straggler_interval, fault.straggler_threshold
        rank = torch.distributed.get_rank()
        self.rank, self.world = rank, torch.distributed.get_world_size()
        self.where = {
            "rank": rank,
            "host": socket.gethostname(),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            # both backends put the pipeline outermost in the rank order (toolkit.train.probe.gather_ranks)
            "stage": rank // (layout.world_size // layout.pp),
        }
        self.window: list[float] = []
        self.first_step: int | None = None

    def step_done(self, step: int, compute_s: float) -> dict | None:
        """Record a step; at the end of a window, rank 0 gets {"steps": [first, last], "slow_ranks":
        [...]} (None elsewhere, between windows and where the watch is off)."""
        if not self.interval or self.world == 1:
            return None
        self.first_step = step if self.first_step is None else self.first_step
        self.window.append(compute_s)
        if step % self.interval:
            return None
        mine = {**self.where, "compute_s": sum(self.window) / len(self.window)}
        steps, self.window, self.first_step = [self.first_step, step], [], None
        everyone = [None] * self.world if self.rank == 0 else None
        torch.distributed.gather_object(mine, everyone, dst=0)
        if self.rank != 0:
            return None
        return {"steps": steps, "slow_ranks": slow_ranks(everyone, self.threshold)}
