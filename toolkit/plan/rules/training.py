"""Activation recompute, the optimizer's learning rates, checkpoint intervals, the profiled steps and
the kernels."""

from __future__ import annotations

from typing import Iterator

from toolkit.config.schema import Config
from toolkit.plan.backends import kernels_of
from toolkit.plan.layout import stage_layer_counts, world_size
from toolkit.plan.rules.base import Violation, divisors, err, listing, warn


def recompute(cfg: Config) -> Iterator[Violation]:
    r, m, p = cfg.recompute, cfg.model, cfg.parallel
    counts = stage_layer_counts(m.num_layers, p.pp, p.vpp, p.first_stage_layers, p.last_stage_layers)
    if r.granularity != "full" or counts is None:
        return
    chunk_sizes = sorted({c // p.vpp for c in counts})
    per_chunk = chunk_sizes[0]
    fields = {"recompute.method": r.method, "recompute.num_layers": r.num_layers, "layers per model chunk": per_chunk}
    if r.num_layers < 1:
        yield err(
            "recompute_layers",
            fields,
            "full recompute needs at least one layer per checkpoint",
            "set recompute.num_layers=1",
        )
    elif r.method == "uniform" and any(size % r.num_layers for size in chunk_sizes):
        common = [d for d in divisors(per_chunk) if all(size % d == 0 for size in chunk_sizes)]
        yield err(
            "recompute_layers",
            fields,
            "uniform recompute checkpoints groups of num_layers, which must tile each chunk",
            f"use recompute.num_layers in {{{listing(common)}}}",
        )
    elif r.method == "block" and r.num_layers > per_chunk:
        yield err(
            "recompute_layers",
            fields,
            "block recompute cannot recompute more layers than a chunk holds",
            f"use recompute.num_layers<={per_chunk}",
        )


def optim(cfg: Config) -> Iterator[Violation]:
    o = cfg.optim
    if o.min_lr > o.lr:
        yield err(
            "min_lr",
            {"optim.lr": o.lr, "optim.min_lr": o.min_lr},
            "the decay would raise the learning rate",
            f"set optim.min_lr<={o.lr} (e.g. {o.lr / 10:g})",
        )
    if o.lr_scaling != "none" and not o.reference_global_batch:
        yield err(
            "lr_reference",
            {"optim.lr_scaling": o.lr_scaling, "optim.reference_global_batch": o.reference_global_batch},
            "a rescaling rule needs the batch the learning rate was tuned at",
            f"set optim.reference_global_batch to that batch (e.g. {cfg.train.global_batch})",
        )


def checkpoint(cfg: Config) -> Iterator[Violation]:
    c = cfg.checkpoint
    if c.auto_interval and c.interval_steps:
        yield err(
            "checkpoint_interval",
            {"checkpoint.auto_interval": True, "checkpoint.interval_steps": c.interval_steps},
            "two save intervals given: the planner's rule picks the interval in steps",
            "set checkpoint.interval_steps=null, or checkpoint.auto_interval=false",
        )


def profile(cfg: Config) -> Iterator[Violation]:
    t = cfg.train
    start, end = t.profile_step_start, t.profile_step_end
    fields = {"train.profile_step_start": start, "train.profile_step_end": end}
    if end is not None and start is None:
        yield err("profile_steps", fields, "a profile needs its first step", f"set train.profile_step_start<{end}")
    elif end is not None and end <= start:
        yield err(
            "profile_steps",
            fields,
            "the profiled steps run from profile_step_start up to, not including, profile_step_end",
            f"set train.profile_step_end>{start} (e.g. {start + 2}), or null for one step",
        )


def profile_window(cfg: Config) -> Iterator[Violation]:
    t = cfg.train
    start, last = t.profile_step_start, t.stop_after_steps or t.steps
    fields = {"train.profile_step_start": start, "train.profile_step_end": t.profile_step_end}
    if start is not None and last and start > last:
        yield warn(
            "profile_steps",
            fields | {"last step": last},
            "the run ends before the first profiled step: nothing is profiled",
            f"set train.profile_step_start<={last}",
        )


def kernels(cfg: Config) -> Iterator[Violation]:
    """train.kernels=fused asks for GPU kernels: megatron-core's fusions are torch-compiled for CUDA and
    Liger's are Triton's."""
    if str(cfg.train.kernels) == "fused" and str(cfg.cluster.device) == "cpu":
        yield err(
            "kernels",
            {"train.kernels": "fused", "cluster.device": "cpu"},
            "the fused kernels (megatron-core's torch-compiled fusions, Liger's Triton kernels) run on CUDA GPUs",
            "set train.kernels=reference (or auto: fused on GPUs, reference on CPU)",
        )


def kernels_kept(cfg: Config) -> Iterator[Violation]:
    """Where train.kernels=fused cannot fuse a part (the loss under ZeRO-3, a family without Liger
    kernels), that part computes with the reference kernels: said, not silent."""
    if str(cfg.train.kernels) != "fused":
        return
    resolved = kernels_of(cfg)
    for why in resolved.kept_reference:
        yield warn(
            "kernels",
            {"train.kernels": "fused", "backend.name": str(cfg.backend.name)},
            f"{why}: the run computes with {resolved.names['layers']} and {resolved.names['loss']}",
            "nothing to change for the run; set train.kernels=auto to silence this",
        )


def loggers(cfg: Config) -> Iterator[Violation]:
    """metrics.jsonl is parakit's own record, which `parakit report`, sweeps and resume read: written
    whether train.loggers names it or not, and said where it does not."""
    chosen = [str(logger) for logger in cfg.train.loggers]
    if "jsonl" not in chosen:
        yield warn(
            "loggers",
            {"train.loggers": "[" + ",".join(chosen) + "]"},
            "the run writes metrics.jsonl in any case: `parakit report`, sweeps and resume read it",
            "add jsonl to train.loggers to silence this",
        )


def fault_ranks(cfg: Config) -> Iterator[Violation]:
    """A fault drill names a rank of the job (else it never fires and the drill passes unseen)."""
    fault, world = cfg.train.fault, world_size(cfg)
    for name in ("kill_rank", "stall_rank", "oom_rank", "slow_rank"):
        rank = getattr(fault, name)
        if rank is not None and rank >= world:
            yield err(
                "fault_rank",
                {f"train.fault.{name}": rank, "ranks": world},
                f"the job has ranks 0..{world - 1}: the drill would never fire",
                f"set train.fault.{name} in 0..{world - 1}",
            )
