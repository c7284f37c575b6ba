"""Layouts that are valid but run slowly or train differently: warnings, with their fix."""

from __future__ import annotations

import math
from typing import Iterator

from toolkit.config.schema import Config
from toolkit.plan.layout import Layout, bubble_fraction
from toolkit.plan.rules.base import Violation, divisors, listing, warn


def slow_layouts(cfg: Config, layout: Layout) -> Iterator[Violation]:
    p, c, o, t, ch = cfg.parallel, cfg.cluster, cfg.optim, cfg.train, cfg.checks
    m = layout.num_microbatches
    if p.pp > 1:
        bubble = bubble_fraction(p.pp, p.vpp, m)
        if bubble > ch.max_bubble_fraction:
            need = math.ceil((p.pp - 1) / (p.vpp * ch.max_bubble_fraction))
            yield warn(
                "bubble",
                {"parallel.pp": p.pp, "parallel.vpp": p.vpp, "micro-batches": m},
                f"the pipeline bubble (pp-1)/(vpp*m) adds {bubble:.0%} idle time to the compute (threshold "
                f"{ch.max_bubble_fraction:.0%})",
                f"raise train.global_batch so that m >= {need} (global_batch >= {need * t.micro_batch * layout.dp}), "
                "lower train.micro_batch, or raise parallel.vpp",
            )
        if m < ch.min_microbatches_per_stage * p.pp:
            yield warn(
                "few_microbatches",
                {"micro-batches": m, "parallel.pp": p.pp},
                f"fewer than {ch.min_microbatches_per_stage}*pp micro-batches per step keep the pipeline mostly "
                "filling and draining",
                f"raise train.global_batch to {ch.min_microbatches_per_stage * p.pp * t.micro_batch * layout.dp} or "
                "lower train.micro_batch",
            )
    if p.tp <= c.gpus_per_node and c.gpus_per_node % p.tp and c.nodes > 1:
        yield warn(
            "tp_spans_nodes",
            {"parallel.tp": p.tp, "cluster.gpus_per_node": c.gpus_per_node},
            "some tensor-parallel groups straddle two nodes and talk over the slow inter-node network",
            f"use parallel.tp in {{{listing(divisors(c.gpus_per_node))}}}",
        )
    if p.tp & (p.tp - 1):
        yield warn(
            "tp_power_of_two",
            {"parallel.tp": p.tp},
            "tensor parallel degrees that are not powers of two give odd GEMM shapes and unbalanced NVLink traffic",
            "use parallel.tp in {1, 2, 4, 8}",
        )
    if o.reference_global_batch and o.reference_global_batch != t.global_batch and o.lr_scaling == "none":
        yield warn(
            "lr_not_rescaled",
            {
                "train.global_batch": t.global_batch,
                "optim.reference_global_batch": o.reference_global_batch,
                "optim.lr_scaling": "none",
            },
            "the global batch changed but the learning rate and warmup did not",
            "set optim.lr_scaling=sqrt (Adam) or linear (SGD), or retune optim.lr and optim.warmup_steps",
        )
    if layout.warmup_steps >= layout.steps:
        yield warn(
            "warmup",
            {"optim.warmup_steps": layout.warmup_steps, "steps": layout.steps},
            "the run ends before the learning-rate warmup does",
            f"set optim.warmup_steps<={max(1, layout.steps // 10)}",
        )
