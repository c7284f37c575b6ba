"""How often to checkpoint: Young's and Daly's optimal intervals, and the rework bound.

With save time delta and mean time between failures M of the whole job (per-GPU MTBF / N GPUs):
  Young (1974), "A first order approximation to the optimum checkpoint interval":
      tau = sqrt(2 delta M)
  Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps",
  eq. 37 (for delta < 2M):  tau = sqrt(2 delta M) [1 + sqrt(delta/(2M))/3 + delta/(18M)] - delta,
      else tau = M.
  A failure loses on average half an interval of work: to keep the expected rework under R,
  tau <= 2R.
An asynchronous save holds training only for its snapshot (each GPU's share copied to host memory),
so delta is that copy, while the write runs on; the interval is at least the write, since a save
waits for the previous one to finish (Megatron-LM's async_utils). Checkpoint latency moves the
optimum little next to its overhead (Vaidya 1997, "Impact of checkpoint latency on overhead ratio
of a checkpointing scheme").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit.config.schema import Config
from toolkit.plan.backends import backend_of
from toolkit.plan.layout import Layout, world_size
from toolkit.plan.params import model_params


def checkpoint_bytes(cfg: Config, layout: Layout) -> float:
    """Weights plus optimizer states of the whole model (what a resumable checkpoint holds)."""
    params = model_params(cfg.model, layout.padded_vocab_size)
    per_param = 4 + 8 if cfg.precision.dtype == "fp32" else 2 + 4 + 8  # (bf16 weights +) fp32 master + Adam m, v
    return params * per_param


def estimated_save_seconds(cfg: Config, layout: Layout) -> float:
    """Every node writes its shards in parallel (distributed checkpointing)."""
    return checkpoint_bytes(cfg, layout) / (cfg.cluster.checkpoint_write_gbs_per_node * 1e9 * cfg.cluster.nodes)


def snapshot_seconds(cfg: Config, layout: Layout) -> float:
    """An asynchronous save's hold-up: each GPU copies its share to host memory at once."""
    link = cfg.cluster.host_link_gbs or cfg.cluster.hbm_bandwidth_gbs
    return checkpoint_bytes(cfg, layout) / world_size(cfg) / (link * 1e9)


def saves_asynchronously(cfg: Config) -> bool:
    """checkpoint.async_save, or where it is null: on the megatron backend on GPUs."""
    if cfg.checkpoint.async_save is not None:
        return cfg.checkpoint.async_save
    return backend_of(cfg).async_save and cfg.cluster.device == "cuda"


@dataclass(frozen=True)
class CheckpointPlan:
    save_seconds: float  # what training is held up by one save
    save_measured: bool
    write_seconds: float  # the save's writes (the hold-up too unless they run asynchronously)
    job_mtbf_hours: float
    young_minutes: float
    daly_minutes: float
    rework_bound_minutes: float
    recommended_minutes: float
    recommended_steps: int | None  # with the planner's step time

    @property
    def overhead(self) -> float:
        """Fraction of time spent saving at the recommended interval."""
        return self.save_seconds / (self.recommended_minutes * 60)


def young_interval(delta: float, mtbf: float) -> float:
    return math.sqrt(2 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    if delta >= 2 * mtbf:
        return mtbf
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(delta / (2 * mtbf)) / 3 + delta / (18 * mtbf)) - delta


def checkpoint_plan(cfg: Config, layout: Layout, step_seconds: float | None = None) -> CheckpointPlan:
    """checkpoint.save_seconds, when given, is the measured hold-up (`parakit train` reports it)."""
    measured = cfg.checkpoint.save_seconds is not None
    write = estimated_save_seconds(cfg, layout)
    held = snapshot_seconds(cfg, layout) if saves_asynchronously(cfg) else write
    delta = cfg.checkpoint.save_seconds if measured else held
    mtbf = cfg.cluster.gpu_mtbf_hours * 3600 / world_size(cfg)
    young, daly = young_interval(delta, mtbf), daly_interval(delta, mtbf)
    rework = 2 * cfg.checkpoint.acceptable_rework_minutes * 60
    recommended = max(min(daly, rework), write if saves_asynchronously(cfg) else 0.0)
    steps = max(1, round(recommended / step_seconds)) if step_seconds else None
    return CheckpointPlan(
        delta, measured, write, mtbf / 3600, young / 60, daly / 60, rework / 60, recommended / 60, steps
    )


def saves_checkpoints(cfg: Config) -> bool:
    """Whether checkpoint.* asks for saves at all: an interval in steps or minutes, or the planner's."""
    c = cfg.checkpoint
    return bool(c.interval_steps or c.interval_minutes or c.auto_interval)


def interval_steps(cfg: Config, layout: Layout, step_seconds: float) -> int | None:
    """The save interval in steps a trainer that counts only steps (Megatron-LM's --save-interval)
    gets for what checkpoint.* asks, with the planner's `step_seconds`: interval_steps; else every
    interval_minutes; else auto_interval's rule with the predicted save (parakit's own trainer
    measures its first save instead); the shortest where several are set. None: no saves."""
    c = cfg.checkpoint
    candidates = [c.interval_steps] if c.interval_steps else []
    if c.interval_minutes:
        candidates.append(max(1, round(c.interval_minutes * 60 / step_seconds)))
    if c.auto_interval and not c.interval_steps:
        candidates.append(checkpoint_plan(cfg, layout, step_seconds).recommended_steps or 1)
    return min(candidates) if candidates else None
