"""`parakit reproduce recipe=NAME [overrides] [--steps K] [--record [--force]]`: run the recipe, then
compare it with its baseline (toolkit.reproduce.compare), or record a new baseline. A GPU recipe on a
machine without GPUs is not run: its published figure is printed beside the planner's prediction.

Exit codes: 0 the comparison passed (or a baseline was recorded), 1 it failed (or the run did), 2 a
bad configuration (no recipe, no baseline, a baseline that would be overwritten without --force).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Callable

from toolkit.config.schema import Config
from toolkit.reproduce import baseline as bl
from toolkit.reproduce.compare import compare, write

# Overrides that leave the numerics alone: where files go, how often the run logs or saves, what it
# measures, where it stops. The rest, when they differ from the baseline's, are named in the output.
NEUTRAL = (
    *("hydra.", "hydra/", "checkpoint.", "train.log_interval", "train.profile_memory", "train.profile_step_"),
    *("train.stop_after_steps", "train.fault.save_on_stop"),
)
WARMUP_STEPS = 2  # left out of the throughput median (start-up, the first allocations)


def _numeric_overrides(overrides: list[str]) -> list[str]:
    return sorted(o for o in overrides if not o.startswith("recipe=") and not o.startswith(NEUTRAL))


def _problem(message: str) -> int:
    print(f"parakit reproduce: {message}", file=sys.stderr)
    return 2


def reproduce(
    cfg: Config, opts, recipe: str | None, overrides: list[str], dirs: list[Path], write_run_dir: Callable
) -> int:
    """`write_run_dir(cfg)` validates and writes the run directory: (layout, run_dir), or None."""
    import torch

    if not recipe or recipe == "null":
        return _problem(
            "name the recipe to reproduce: parakit reproduce recipe=NAME (`parakit reproduce --help` lists them)"
        )
    path = bl.baseline_path(recipe, dirs)
    try:
        baseline = bl.load(path) if path else None
    except bl.BaselineError as e:
        return _problem(str(e))
    if cfg.cluster.device == "cuda" and not torch.cuda.is_available():
        if opts.record:
            return _problem(
                f"recipe {recipe} runs on GPUs and this machine has none: nothing to record here (a GPU recipe's "
                f"baseline is its published figures, in {bl.record_path(recipe, dirs)})"
            )
        return predicted_only(cfg, recipe, baseline)
    if baseline is None and not opts.record:
        return _problem(
            f"recipe {recipe} has no baseline ({bl.BASELINES}/{recipe}.yaml in the config search path): "
            f"record one with parakit reproduce recipe={recipe} --record"
        )
    if opts.record and cfg.train.stop_after_steps:
        return _problem("--record keeps the whole recipe's curve: drop --steps (train.stop_after_steps)")

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, profile_memory=True))  # tensor bytes on CPU
    written = write_run_dir(cfg)
    if written is None:
        return 2
    layout, run_dir = written
    from toolkit.train.launch import train_here

    code = train_here(cfg, layout, run_dir)
    if code != 0:
        print(f"reproduce {recipe}: FAIL: the run exited with {code}; nothing compared (its log: {run_dir})")
        return 1
    from toolkit.report.sweep import loss_curve, lr_curve, measured

    losses, lrs = loss_curve(run_dir), lr_curve(run_dir)
    figures = measured(run_dir, WARMUP_STEPS)
    hardware = bl.hardware_class(str(cfg.cluster.device))
    if opts.record:
        return record(cfg, recipe, overrides, dirs, baseline, (losses, lrs), figures, hardware, opts.force)

    comparison = compare(baseline, losses, hardware, figures, loss_tolerance(baseline, cfg, hardware), lrs)
    if baseline.loss_hardware and baseline.loss_hardware != hardware:
        comparison.notes.append(
            f"the loss curve was recorded on {baseline.loss_hardware}: on this machine fp32 sums in another order "
            f"(within {comparison.tolerance:g} expected; a mixture of experts' routing can amplify it)"
        )
    mine, theirs = _numeric_overrides(overrides), _numeric_overrides(baseline.overrides)
    if mine != theirs:
        comparison.notes.append(
            f"this run's overrides {' '.join(mine) or '(none)'} differ from the baseline's "
            f"{' '.join(theirs) or '(none)'}"
        )
    print(comparison.table())
    for note in comparison.notes:
        print(f"note: {note}")
    for written_path in write(comparison, baseline, run_dir):
        print(f"wrote {written_path}")
    print(comparison.verdict(), flush=True)
    return 0 if comparison.ok else 1


def _loss_tolerance(cfg: Config) -> float:
    return bl.LOSS_TOLERANCE[str(cfg.precision.dtype)]


def loss_tolerance(baseline: bl.Baseline, cfg: Config, hardware: str) -> float:
    """The loss band of a comparison: none where the run repeats bit for bit (the hardware class
    the curve was recorded on, fp32 on CPU), else the baseline's."""
    same = bl.SAME_CLASS_LOSS_TOLERANCE.get((str(cfg.cluster.device), str(cfg.precision.dtype)))
    if same is not None and baseline.loss_hardware == hardware:
        return same
    return baseline.loss_tolerance if baseline.loss_tolerance is not None else _loss_tolerance(cfg)


def _differences(old: bl.Baseline, new: bl.Baseline, hardware: str) -> list[str]:
    """What the new recording expects that the stored baseline does not."""
    found = []
    if _numeric_overrides(old.overrides) != _numeric_overrides(new.overrides):
        found.append(f"overrides {old.overrides} -> {new.overrides}")
    tolerance = old.loss_tolerance or 0.0
    if set(old.loss) != set(new.loss):
        found.append(f"the curve's steps (1..{max(old.loss, default=0)} -> 1..{max(new.loss, default=0)})")
    else:
        worst = max(old.loss, key=lambda s: abs(old.loss[s] - new.loss[s]), default=None)
        if worst is not None and abs(old.loss[worst] - new.loss[worst]) > tolerance:
            found.append(f"the loss at step {worst} ({old.loss[worst]:.6f} -> {new.loss[worst]:.6f})")
    from toolkit.reproduce.compare import first_lr_mismatch

    if old.lr and (mismatch := first_lr_mismatch(old.lr, new.lr)):
        found.append(f"the learning rate at step {mismatch[0]} ({mismatch[1]:.6g} -> {mismatch[2]:.6g})")
    before, after = old.hardware.get(hardware), new.hardware[hardware]
    if before is not None:
        if abs(after.tokens_per_s / before.tokens_per_s - 1) > before.tokens_per_s_tolerance:
            found.append(f"throughput on {hardware} ({before.tokens_per_s:,.0f} -> {after.tokens_per_s:,.0f} tokens/s)")
        if (
            before.memory_gib
            and after.memory_gib
            and abs(after.memory_gib / before.memory_gib - 1) > before.memory_tolerance
        ):
            found.append(f"peak tensor memory on {hardware} ({before.memory_gib:.3f} -> {after.memory_gib:.3f} GiB)")
    return found


def record(cfg, recipe, overrides, dirs, existing, curves, figures, hardware, force) -> int:
    from toolkit.formats.atomic import write_atomic

    losses, lrs = curves
    device = str(cfg.cluster.device)
    previous = existing.hardware.get(hardware) if existing else None
    new = bl.Baseline(
        recipe=recipe,
        overrides=_numeric_overrides(overrides),
        loss=losses,
        # a band set from a measured spread across hardware classes (the MoE's) survives a new recording
        loss_tolerance=existing.loss_tolerance
        if existing and existing.loss_tolerance is not None
        else _loss_tolerance(cfg),
        loss_hardware=hardware,
        lr=lrs,
        hardware={
            **(existing.hardware if existing else {}),
            hardware: bl.Measured(
                tokens_per_s=float(figures["tokens_per_s"]),
                tokens_per_s_tolerance=bl.THROUGHPUT_TOLERANCE[device],
                memory_gib=figures.get("memory_gib"),
                # a band widened for a recipe's measured spread (the MoE's) survives a new recording
                memory_tolerance=previous.memory_tolerance if previous else bl.MEMORY_TOLERANCE,
            ),
        },
        published=existing.published if existing else None,
        provenance=bl.provenance(
            ["parakit", "reproduce", f"recipe={recipe}", *_numeric_overrides(overrides), "--record"], device
        ),
    )
    path = bl.record_path(recipe, dirs)
    if existing is not None and not force:
        differences = _differences(existing, new, hardware)
        if differences:
            return _problem(f"{path} holds a different baseline ({'; '.join(differences)}); --force replaces it")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, new.to_yaml())
    print(f"recorded the baseline of {recipe} in {path}: {len(losses)} step(s) of loss, {hardware}")
    return 0


def predicted_only(cfg: Config, recipe: str, baseline: bl.Baseline | None) -> int:
    """A GPU recipe on a machine without GPUs: the published figure beside the planner's prediction."""
    from toolkit.plan.layout import resolve
    from toolkit.plan.memory import GIB, peak_memory
    from toolkit.plan.perf import estimate_step

    c = cfg.cluster
    layout = resolve(cfg)
    print(
        f"reproduce {recipe}: not run: the recipe trains on {layout.world_size} x {c.gpu} ({c.nodes} node(s) x "
        f"{c.gpus_per_node}) and this machine has no GPU"
    )
    published = baseline.published if baseline else None
    if published is None:
        print("published: none recorded for this recipe (no baselines/ entry with a source)")
    else:
        print(f"published: {published.source}")
        if published.quote:
            print(f'  "{published.quote}"')
        if published.figures:
            figures = (
                f"{k} {v:,}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in published.figures.items()
            )
            print("  " + ", ".join(figures))
        if published.conditions:
            print(f"  conditions: {published.conditions}")
    step = estimate_step(cfg, layout)
    memory = peak_memory(cfg, layout).total / GIB
    print(
        "prediction (parakit's planner, not a measurement): "
        f"step {step.step_time:.3g} s, {step.tokens_per_s:,.0f} tokens/s ({step.tokens_per_s / layout.world_size:,.0f} "
        f"per GPU), {step.tflops_per_gpu:.0f} TFLOP/s per GPU, MFU {step.mfu:.1%}, peak memory {memory:.1f} GiB per GPU"
    )
    predicted = {
        "tflops_per_gpu": step.tflops_per_gpu,
        "mfu": step.mfu,
        "tokens_per_s_per_gpu": step.tokens_per_s / layout.world_size,
    }
    for key, value in published.figures.items() if published else ():
        if key in predicted and isinstance(value, (int, float)) and value:
            print(
                f"  {key}: predicted {predicted[key]:,.4g} vs published {value:,.4g} "
                f"({predicted[key] / value - 1:+.0%})"
            )
    return 0
