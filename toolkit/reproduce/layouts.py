"""`parakit reproduce recipe=NAME --layouts tp2_pp2_vpp2,pp4_vpp2,dp4 [--backends megatron,deepspeed]`:
the recipe trained in each layout (and backend) from the same initial weights, each loss curve set
against the first one's -- the guide's "small-scale correctness first, then scale", as a command to
run before spending GPU hours on a new layout.

Every run has the same padded vocabulary (megatron pads it to a multiple of 128 x tp: the padding
rows enter the softmax, so layouts with another tp would differ by them). The megatron runs start
from the first one's initial weights (train.save_init_checkpoint, then train.init_checkpoint:
megatron-core's initialisation depends on tp); the DeepSpeed runs from the same weights converted
to transformers (toolkit.interop.megatron_to_hf), or, without a megatron run, from DeepSpeed's own
seed-only initialisation.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from toolkit.config.schema import Config
from toolkit.plan.parallel_dims import ParallelDims, parse_degrees
from toolkit.report.sweep import loss_curve

# fp32 on CPU: layouts sum partial products in another order (tp splits the GEMMs, dp the batch):
# measured 9.5e-7 (one float32 ulp at 10.8) over the demo's first 3 steps, megatron dp4 and
# DeepSpeed dp4 against tp2 pp2 vpp2; tests/test_train_megatron.py bounds 4 steps by 4e-6. 1e-5 per
# step is the bound the issue sets for fp32.
LAYOUT_TOLERANCE = 1e-5
# Between backends (megatron-core and transformers under DeepSpeed) attention and norms round
# differently: tests/test_cross_backend.py measured equal losses over 10 steps and bounds them by
# 1e-6; over a recipe's longer curve at a higher learning rate Adam amplifies the rounding, so
# the bound here is the layouts' 1e-5 scaled by the curve's length in tens of steps.
CROSS_BACKEND_TOLERANCE_PER_10_STEPS = 1e-5
# The demo recipe (lr 3e-3, the gradient clipped at every step from step 5) over its 40 steps as
# tp2_pp2_vpp2, pp4_vpp2 and dp4 on megatron and dp4 on DeepSpeed: equal within 3.8e-6 through
# step 6, then megatron pp4_vpp2 and DeepSpeed dp4 move away (7e-5 at step 7, 1e-2 and 8e-4 at
# step 11; 2.8e-2 and 1.6e-3 at most; megatron dp4 5e-5); at lr 3e-4 all four agree within
# 3.8e-6 over 20 steps. A layout defect (doubled gradients, a layer never updated:
# tests/test_train_*.py) shows from the first steps, so a run that agrees this long before
# separating is reported as rounding amplified.
LATE_DIVERGENCE_STEPS = 3


class LayoutError(ValueError):
    """A layout name that does not parse; the message names it and the syntax."""


@dataclass(frozen=True)
class Variant:
    backend: str
    layout: str
    sizes: dict

    @property
    def name(self) -> str:
        return f"{self.backend}-{self.layout}"

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(**self.sizes)

    @property
    def world_size(self) -> int:
        return self.dims.world_size


def parse_layout(name: str) -> dict:
    """`tp2_pp2_vpp2` -> {"tp": 2, "pp": 2, "vpp": 2} (toolkit.plan.parallel_dims); the world size
    is their product, the dimensions not named 1."""
    try:
        return parse_degrees(name)
    except ValueError as e:
        raise LayoutError(f"--layouts: {name!r}: {e} (e.g. tp2_pp2_vpp2, pp4_vpp2, dp4)") from None


def variants(layouts: str, backends: str) -> list[Variant]:
    names = [n for n in layouts.split(",") if n]
    chosen = [b for b in backends.split(",") if b]
    unknown = [b for b in chosen if b not in ("megatron", "deepspeed")]
    if unknown:
        raise LayoutError(f"--backends: {', '.join(unknown)}: the backends are megatron and deepspeed")
    sizes = {n: parse_layout(n) for n in names}  # a bad name first: it is the likelier mistake
    if len(names) * len(chosen) < 2:
        raise LayoutError("--layouts/--backends: give at least two runs to compare (two layouts, or two backends)")
    chosen.sort(key=lambda b: b != "megatron")  # megatron first: the DeepSpeed runs start from its weights
    return [Variant(b, n, sizes[n]) for b in chosen for n in names]


def variant_overrides(v: Variant, vocab_size: int) -> list[str]:
    return [
        f"backend={v.backend}",
        *v.dims.overrides(),
        "cluster.nodes=1",
        f"cluster.gpus_per_node={v.world_size}",
        f"model.vocab_size={vocab_size}",
    ]


def common_vocab(cfg: Config) -> int:
    """The vocabulary every run trains with: the recipe's, padded as megatron pads it, so that
    the DeepSpeed runs (unpadded transformers models) hold the same rows."""
    from toolkit.plan.layout import padded_vocab_size

    return padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by)


def _train(command: list[str], run_dir: Path) -> int:
    """One variant's `parakit train`, in a session of its own: a stop signal stops it (and its ranks)."""
    from toolkit.train.stop import run_group

    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "reproduce-train.log", "w") as log:
        return run_group(command, stdout=log)


def reproduce_layouts(cfg: Config, opts, recipe: str, overrides: list[str], out_dir: Path) -> int:
    try:
        runs = variants(opts.layouts, opts.backends)
    except LayoutError as e:
        print(f"parakit reproduce: {e}", file=sys.stderr)
        return 2
    vocab = common_vocab(cfg)
    user = [o for o in overrides if not o.startswith(("recipe=", "hydra."))]
    base = [sys.executable, "-m", "toolkit.cli", "train", *sum((["--config-dir", d] for d in opts.config_dir), [])]
    init, hf = out_dir / "initial-weights", out_dir / "initial-weights-hf"
    started = time.time()
    curves: dict[str, dict[int, float]] = {}
    trained: list[Variant] = []
    init_from: Variant | None = None  # the megatron run that saved the initial weights
    for i, v in enumerate(runs, 1):
        run_dir = out_dir / v.name
        if v.backend == "megatron":
            weights = [f"train.init_checkpoint={init}"] if init_from else [f"train.save_init_checkpoint={init}"]
        elif init_from is not None:
            if not hf.exists() and not _convert(init_from, init, hf, out_dir):
                return 1
            weights = [f"model.hf_path={hf}"]
        else:
            weights = []  # DeepSpeed alone: its initialisation depends only on the seed
        command = [*base, f"recipe={recipe}", *user, *variant_overrides(v, vocab), *weights, f"hydra.run.dir={run_dir}"]
        code = _train(command, run_dir)
        elapsed = time.time() - started
        outcome = {0: "done", 2: "invalid: not run"}.get(code, f"FAILED (exit {code})")
        print(
            f"run {i}/{len(runs)} {v.name} ({v.world_size} ranks): {outcome} ({elapsed:.0f} s elapsed, about "
            f"{elapsed / i * (len(runs) - i):.0f} s to go)",
            flush=True,
        )
        if code == 2:  # the validator refused the layout for this backend: its rules, then the next run
            log = (run_dir / "reproduce-train.log").read_text(errors="replace").splitlines()
            print("\n".join(f"  {line}" for line in log if line.startswith("error [")), flush=True)
            continue
        if code != 0:
            print(f"reproduce {recipe}: FAIL: {v.name} did not train; its log: {run_dir / 'reproduce-train.log'}")
            return 1
        if v.backend == "megatron" and init_from is None:
            init_from = v
        trained.append(v)
        curves[v.name] = loss_curve(run_dir)
    if len(trained) < 2:
        print(f"parakit reproduce: {len(trained)} of the runs is valid: nothing to compare", file=sys.stderr)
        return 2
    return _compare(recipe, trained, curves, out_dir)


def _convert(source: Variant, init: Path, hf: Path, out_dir: Path) -> bool:
    """megatron's initial weights as a transformers directory, for the DeepSpeed runs."""
    converted = subprocess.run(
        [sys.executable, "-m", "toolkit.interop.megatron_to_hf", "--config", str(out_dir / source.name / "config.yaml"),
         "--checkpoint", str(init), "--out", str(hf)],
        capture_output=True, text=True,
    )  # fmt: skip
    if converted.returncode != 0:
        print("parakit reproduce: converting megatron's initial weights for the DeepSpeed runs failed:")
        print(converted.stderr[-2000:])
    return converted.returncode == 0


def _tolerance(reference: Variant, v: Variant, steps: int) -> float:
    if v.backend == reference.backend:
        return LAYOUT_TOLERANCE
    return CROSS_BACKEND_TOLERANCE_PER_10_STEPS * max(1.0, steps / 10)


def agrees_through(deviations: dict[int, float], tolerance: float) -> int:
    """The last step up to which every step is within the tolerance (0: not even the first)."""
    last = 0
    for s in sorted(deviations):
        if not (math.isfinite(deviations[s]) and deviations[s] <= tolerance):
            break
        last = s
    return last


def _compare(recipe: str, runs: list[Variant], curves: dict, out_dir: Path) -> int:
    reference = runs[0]
    ref = curves[reference.name]
    steps = sorted(ref)
    others = runs[1:]
    print(f"loss per step; the deviation of each run from {reference.name}:")
    header = f"{'step':>5}  {reference.name:>22}" + "".join(f"  {v.name:>22}" for v in others)
    lines = [header]
    for s in steps:
        cells = "".join(f"  {abs(curves[v.name].get(s, math.nan) - ref[s]):>22.2e}" for v in others)
        lines.append(f"{s:>5}  {ref[s]:>22.6f}{cells}")
    print("\n".join(lines))
    results, ok, diverged_late = [], True, False
    for v in others:
        tolerance = _tolerance(reference, v, len(steps))
        deviations = {s: abs(curves[v.name].get(s, math.nan) - ref[s]) for s in steps}
        worst = max(deviations, key=lambda s: deviations[s] if math.isfinite(deviations[s]) else math.inf)
        agrees = agrees_through(deviations, tolerance)
        passed = agrees == steps[-1]
        ok &= passed
        results.append(
            {
                "run": v.name,
                "max_deviation": deviations[worst],
                "at_step": worst,
                "tolerance": tolerance,
                "pass": passed,
                "agrees_through_step": agrees,
            }
        )
        line = (
            f"{v.name}: max deviation {deviations[worst]:.2e} at step {worst}, tolerance {tolerance:g} "
            f"({'same backend' if v.backend == reference.backend else 'across backends'}): {'ok' if passed else 'FAIL'}"
        )
        if not passed and agrees and worst > agrees + 1 and math.isfinite(deviations[worst]):
            first = agrees + 1  # the first step beyond the tolerance
            growth = (deviations[worst] / max(deviations[first], 1e-12)) ** (1 / (worst - first))
            line += f"; within it through step {agrees}, then growing x{growth:.1f} per step to step {worst}"
            diverged_late |= agrees >= LATE_DIVERGENCE_STEPS
        print(line)
    if diverged_late:
        print(
            "note: curves that agree for the first steps and then separate geometrically are fp32 rounding amplified\n"
            "  by the training itself (a high learning rate, the gradient clipped every step): measured for\n"
            "  tiny_cpu_demo, whose layouts agree within 4e-6 over 20 steps at a tenth of its learning rate. A layout\n"
            "  defect shows from the first steps. Check the layouts over the steps that agree (--steps N), or at a\n"
            "  lower learning rate (optim.lr=...)."
        )
    from toolkit.formats.atomic import write_atomic

    document = {"recipe": recipe, "reference": reference.name, "pass": ok, "runs": results, "curves": curves}
    write_atomic(out_dir / "reproduce_layouts.json", json.dumps(document, indent=2) + "\n")
    _plot(recipe, curves, out_dir / "reproduce_layouts.png")
    print(f"wrote {out_dir / 'reproduce_layouts.json'}\nwrote {out_dir / 'reproduce_layouts.png'}")
    print(f"reproduce {recipe} across {len(runs)} runs: {'PASS' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


def _plot(recipe: str, curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for i, (name, curve) in enumerate(curves.items()):
        steps = sorted(curve)
        ax.plot(steps, [curve[s] for s in steps], linestyle=("-", "--", ":", "-.")[i % 4], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{recipe}: the same training in every layout and backend")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
