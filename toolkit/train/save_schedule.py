"""When a training loop saves: every `checkpoint.interval_steps`, every `interval_minutes` of wall
time, at the planner's interval (`auto_interval`: Daly's interval capped by the rework bound,
toolkit.plan.checkpoint, from the cluster MTBF and the save and step times measured at the first
step, which always saves), and always at the last step.

Every rank must agree on a save (it is collective): rank 0's clock and rank 0's measurements
decide for everybody.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from toolkit.config.schema import Config
from toolkit.plan.checkpoint import checkpoint_plan, saves_checkpoints
from toolkit.plan.layout import Layout


class SaveSchedule:
    def __init__(self, cfg: Config, layout: Layout):
        c = cfg.checkpoint
        self.cfg, self.layout = cfg, layout
        self.enabled = saves_checkpoints(cfg)
        self.interval_steps = c.interval_steps
        self.last_save = time.monotonic()

    def due(self, step: int) -> bool:
        if not self.enabled:
            return False
        if step == self.layout.last_step or (self.interval_steps and step % self.interval_steps == 0):
            return True
        if self.cfg.checkpoint.auto_interval and self.interval_steps is None:
            return True  # the first save measures the save time the planner's rule needs
        if not self.cfg.checkpoint.interval_minutes:
            return False
        elapsed_minutes = (time.monotonic() - self.last_save) / 60
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        decision = torch.tensor(
            [elapsed_minutes >= self.cfg.checkpoint.interval_minutes], dtype=torch.uint8, device=device
        )
        torch.distributed.broadcast(decision, src=0)
        return bool(decision.item())

    def saved(self, step: int, save_seconds: float, step_seconds: float | None) -> None:
        """After a save: restart the clock; the first save also fixes the planner's interval."""
        self.last_save = time.monotonic()
        if torch.distributed.get_rank() == 0:
            print(f"checkpoint of step {step}: training held up {save_seconds:.3f} s", flush=True)
        if self.cfg.checkpoint.auto_interval and self.interval_steps is None:
            self.interval_steps = self._planned_interval(save_seconds, step_seconds)

    def _planned_interval(self, save_seconds: float, step_seconds: float | None) -> int:
        """Daly's interval for the time a save holds training up (the blocking part only, when
        the writes go on in the background)."""
        measured = [save_seconds, step_seconds]
        torch.distributed.broadcast_object_list(measured, src=0)
        save_seconds, step_seconds = measured
        checkpoint = dataclasses.replace(self.cfg.checkpoint, save_seconds=save_seconds)
        plan = checkpoint_plan(dataclasses.replace(self.cfg, checkpoint=checkpoint), self.layout, step_seconds)
        if torch.distributed.get_rank() == 0:
            print(
                f"checkpoint interval: every {plan.recommended_steps} steps ({plan.recommended_minutes:.2f} min; save "
                f"{plan.save_seconds:.3f} s, step {step_seconds:.3f} s, job MTBF {plan.job_mtbf_hours:.2f} h)",
                flush=True,
            )
        return plan.recommended_steps or 1
