"""The learning rate of every training step, the same on both backends.

Linear warmup from 0 to the peak over `warmup_steps` updates (Goyal et al. 2017, section 2.2),
then cosine (Loshchilov & Hutter 2017, eq. 5, without restarts) or linear decay to `min_lr` by
`decay_steps`, or a constant peak; `min_lr` after the decay. Step for step this is megatron-core's
OptimizerParamScheduler.get_lr (megatron/core/optimizer_param_scheduler.py), which the megatron
backend runs with the arguments `scheduler_arguments` gives; the deepspeed backend steps this
function. DeepSpeed's own WarmupCosineLR/WarmupDecayLR/WarmupLR cannot express it: they set their
first warmup value before the first update and again after it (the warmup runs a step late), the
cosine starts one step past its peak, and the warmup lasts at least 2 steps.

Pure arithmetic: the expressions and their order are megatron-core's, so the floats are equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit.config.schema import Config


@dataclass(frozen=True)
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int  # > warmup_steps
    style: str  # cosine | linear | constant

    def lr(self, updates: int) -> float:
        """The learning rate after `updates` optimizer updates: the one step `updates + 1` uses."""
        if self.warmup_steps > 0 and updates <= self.warmup_steps:
            return 0.0 + (self.max_lr - 0.0) * float(updates) / float(self.warmup_steps)
        if self.style == "constant":
            return self.max_lr
        if updates > self.decay_steps:
            return self.min_lr
        decay_ratio = float(updates - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        coeff = 1.0 - decay_ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)


def lr_schedule(cfg: Config, layout) -> LRSchedule:
    """The schedule of a resolved layout (learning rate and warmup already rescaled for its batch)."""
    return LRSchedule(
        max_lr=layout.lr,
        min_lr=layout.min_lr,
        warmup_steps=layout.warmup_steps,
        decay_steps=max(layout.decay_steps, layout.warmup_steps + 1),
        style=cfg.optim.decay_style,
    )
