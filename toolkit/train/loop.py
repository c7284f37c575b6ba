"""The training loop, once for every backend: resume, steps, the NaN policy, the save schedule,
the watchdog, fault injection and metrics. A backend supplies its side as `BackendSteps`
(toolkit.plan.backends names the module; its `setup(cfg, layout)` returns one).

A step is forward+backward over the step's micro-batches, then (when the gradients are finite,
or the backend's own overflow check dropped the update) the optimizer update.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch

from toolkit.config.schema import Config
from toolkit.plan.checkpoint import checkpoint_bytes
from toolkit.plan.layout import Layout
from toolkit.train.checkpoint import Resume, refuse_to_start_over
from toolkit.train.checkpoint_space import space_named, warn_if_short
from toolkit.train.faults import Watchdog, first_attempt, inject_step_faults, slow_down
from toolkit.train.metrics import Metrics
from toolkit.train.preemption import Preemption
from toolkit.train.probe import ComputeTimers, MemoryProbe, gather_ranks
from toolkit.train.save_schedule import SaveSchedule
from toolkit.train.step_profiler import StepProfiler
from toolkit.train.stragglers import StragglerWatch


@dataclass
class Gradients:
    """What forward+backward of one step left: the mean loss over micro-batches and data-parallel
    replicas (the same on every rank), and whether the reduced gradients are finite (None: the
    backend's optimizer checks them itself)."""

    loss: float
    grads_finite: bool | None = None
    # other losses of the step to log (mixture-of-experts: the router's load-balancing and z-losses)
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class Update:
    applied: bool  # False: the optimizer skipped it (an fp16 loss-scale overflow)
    grad_norm: float | None


class BackendSteps(Protocol):
    """One backend's side of the loop."""

    compute: ComputeTimers  # the seconds this rank spends in forward and backward compute

    def load(self, root: Path) -> Resume:
        """Restore the newest good checkpoint under `root` (collectively); Resume() when none."""

    def begin_at(self, step: int) -> None:
        """Position the data at the first sample after `step` steps."""

    def forward_backward(self, step: int, poison: bool, beat: Callable[[int], None]) -> Gradients:
        """Forward and backward over the step's micro-batches; `poison` makes the loss NaN before
        the backward pass (train.fault.nan_at_step); `beat(step)` after each micro-batch."""

    def evaluate(self) -> float:
        """The mean loss over the validation batches (toolkit.train.data.eval_batches), forward
        only, the same on every rank."""

    def update(self) -> Update:
        """The optimizer step (and the learning-rate schedule's)."""

    def update_applied_anyway(self) -> bool:
        """After non-finite gradients and no update() call: whether an update happened anyway
        (DeepSpeed steps inside forward_backward and drops it only with an overflow check)."""

    def lr(self) -> float:
        """The learning rate now."""

    def kernels(self) -> dict:
        """What the run computes with, for its summary: {"attention": ..., "adam": ...}."""

    def save(self, root: Path, step: int, resumed_from: str | None) -> float:
        """A verified checkpoint of `step`; the seconds training was held up. Pruning never deletes
        `resumed_from` (the checkpoint the run resumed from)."""

    def settle_saves(self, blocking: bool) -> None:
        """Publish background saves that finished (all of them when `blocking`)."""

    def close(self) -> None:
        """Release the engine and the process groups."""


def checkpoint_root(cfg: Config, run_dir: Path) -> Path:
    return checkpoint_folder(cfg.checkpoint.dir, run_dir)


def checkpoint_folder(directory: str | None, run_dir: Path) -> Path:
    """Where a run saves: checkpoint.dir, else <run dir>/checkpoints."""
    return Path(directory) if directory else run_dir / "checkpoints"


def _rank() -> int:
    return torch.distributed.get_rank()


class NanPolicy:
    """train.fault.nan_action on a non-finite loss or gradients: stop with the last good checkpoint
    kept, or skip the update (the learning-rate schedule waits)."""

    def __init__(self, cfg: Config, root: Path, backend_name: str):
        self.action, self.root, self.backend_name = cfg.train.fault.nan_action, root, backend_name

    @staticmethod
    def problem(grads: Gradients) -> str | None:
        bad_loss, bad_grads = not math.isfinite(grads.loss), grads.grads_finite is False
        if not (bad_loss or bad_grads):
            return None
        return "non-finite " + " and ".join([f"loss {grads.loss}"] * bad_loss + ["gradients"] * bad_grads)

    def stop(self, what: str, step: int, why: str) -> FloatingPointError:
        return FloatingPointError(
            f"{what} at step {step}; stopping with the last good checkpoint in {self.root} kept ({why})"
        )

    def check(self, what: str, step: int, steps: BackendSteps) -> None:
        """Raise to stop; return when the step is skipped."""
        if self.action == "stop":
            raise self.stop(what, step, "train.fault.nan_action=skip skips such steps")
        if steps.update_applied_anyway():
            raise self.stop(
                what, step, f"{self.backend_name} applied the update (no overflow check in this configuration)"
            )
        if _rank() == 0:
            print(f"{what} at step {step}: update skipped (train.fault.nan_action=skip)", flush=True)


def train(
    cfg: Config,
    layout: Layout,
    run_dir: Path,
    steps: BackendSteps,
    backend_name: str,
    memory: MemoryProbe | None = None,
) -> list[float]:
    """Train `steps` from the newest good checkpoint (or step 0) to layout.steps; the loss curve.
    `memory`: the probe started before the model was built (toolkit.train.probe)."""
    memory = memory or MemoryProbe(profile_tensors=False)
    compute_s = []  # this rank's forward+backward compute seconds per step
    root = checkpoint_root(cfg, run_dir)
    fault = cfg.train.fault
    if not cfg.checkpoint.resume:  # from step 0: never over an earlier run's checkpoints
        refuse_to_start_over(root, None)
    loading = time.perf_counter()
    resume = steps.load(root) if cfg.checkpoint.resume else Resume()
    resume.load_seconds = time.perf_counter() - loading if resume.checkpoint else None
    if resume.checkpoint and resume.step >= layout.last_step and _rank() == 0:
        print(
            f"nothing to train: the checkpoint resumed is at step {resume.step}, the run ends at step "
            f"{layout.last_step} (train.steps, train.stop_after_steps); raise train.steps to train on",
            flush=True,
        )
    steps.begin_at(resume.step)
    metrics = Metrics(cfg, layout, run_dir, enabled=_rank() == 0, resume=resume, kernels=steps.kernels())
    watchdog = Watchdog(fault.watchdog_timeout_s)
    schedule = SaveSchedule(cfg, layout)
    nan_policy = NanPolicy(cfg, root, backend_name)
    preemption = Preemption(run_dir)
    profiler = StepProfiler(cfg.train, run_dir, enabled=_rank() == 0)
    stragglers = StragglerWatch(fault, layout)
    estimate = checkpoint_bytes(cfg, layout)  # a save's size until one is published
    try:
        for step in range(resume.step + 1, layout.last_step + 1):
            with profiler.step(step):
                inject_step_faults(fault, step)
                poison = fault.nan_at_step == step and first_attempt()
                steps.compute.reset()  # evaluation's forward passes are not the step's
                grads = steps.forward_backward(step, poison, watchdog.beat)
                slow_down(fault, steps.compute)
                compute_s.append(steps.compute.seconds)
                window = stragglers.step_done(step, compute_s[-1])
                if window and window["slow_ranks"]:
                    metrics.slow_ranks(step, window)
                problem = nan_policy.problem(grads)
                if problem:
                    nan_policy.check(problem, step, steps)
                    metrics.step(step, grads.loss, steps.lr(), None, True)
                    memory.step_done()
                    continue
                update = steps.update()
                metrics.step(step, grads.loss, steps.lr(), update.grad_norm, not update.applied, grads.extra)
                memory.step_done()
                if cfg.train.eval_interval and (step % cfg.train.eval_interval == 0 or step == layout.last_step):
                    with watchdog.suspended():
                        metrics.evaluated(step, steps.evaluate())
                save_now = schedule.due(step)
                with watchdog.suspended(), space_named(root, estimate):
                    steps.settle_saves(blocking=save_now)  # one save in flight at a time
                    if save_now:
                        if _rank() == 0:
                            warn_if_short(root, estimate)
                        held_up = steps.save(root, step, resume.checkpoint)
                        schedule.saved(step, held_up, metrics.history[-1]["step_time_s"])
                if step < layout.last_step and preemption.requested():
                    with watchdog.suspended(), space_named(root, estimate):
                        if not save_now:
                            steps.settle_saves(blocking=True)  # one save in flight at a time
                            steps.save(root, step, resume.checkpoint)
                        steps.settle_saves(blocking=True)
                    preemption.stopped(step, root)
                    profiler.close()
                    losses = metrics.close(run_dir, complete=False)  # result.json is the finished run's
                    steps.close()
                    return losses
    except FloatingPointError:
        with watchdog.suspended():
            steps.settle_saves(blocking=True)  # the save in flight holds finite weights: publish it
        profiler.close()
        metrics.close(run_dir, complete=False)
        raise
    except BaseException:
        metrics.abandon()
        raise
    profiler.close()  # a window past the last step
    with watchdog.suspended():
        with space_named(root, estimate):
            steps.settle_saves(blocking=True)
        memory.close()
        ranks = gather_ranks(compute_s, memory, layout.world_size, layout.pp)
    losses = metrics.close(run_dir, ranks=ranks)
    preemption.finished()
    steps.close()
    return losses
