"""`parakit scale`: the guide's scaling curve, measured. Start from the composed (validated, small)
layout and double one dimension at a time, recording throughput and the gain of each doubling;
the curve says where a doubling stops paying (under 1.6x per 2x by default).

Weak scaling keeps the batch per data-parallel rank fixed (the global batch grows with dp);
strong scaling keeps the global batch fixed. Ranks fill a node first (the composed cluster's
gpus_per_node), then whole nodes. Each point is a sweep point (validated, trained through
torchrun, recorded in SWEEP_DIR/sweep.json with the "scaling" block `parakit report` draws).
"""

from __future__ import annotations

import time
from pathlib import Path

from toolkit.config.schema import Config, as_name
from toolkit.plan.doublings import doublings, first_below, verdict
from toolkit.plan.scaling import node_shape, sizes
from toolkit.plan.validate import validate
from toolkit.report.sweep import (
    SweepOptions,
    SweepRecordError,
    describe_sweep,
    point_dir,
    progress_line,
    read_rows,
    run_point,
)

# ep: the added ranks are data-parallel replicas of the attention that the experts spread over
# (expert parallel folds into them: megatron-core's etp x ep x edp = tp x cp x dp)
DIMENSIONS = ("dp", "tp", "pp", "ep")
MODES = ("weak", "strong")


class ScaleError(ValueError):
    pass


def parse_range(text: str) -> tuple[int, int]:
    """ "1..8" -> (1, 8): powers of two, start <= end."""
    try:
        low, high = (int(x) for x in text.split(".."))
    except ValueError:
        raise ScaleError(f"ranks {text!r}: expected START..END, e.g. 1..8") from None
    if low < 1 or high < low or low & (low - 1) or high & (high - 1):
        raise ScaleError(f"ranks {text!r}: START and END must be powers of two with START <= END, e.g. 1..8")
    return low, high


def point_overrides(cfg: Config, dim: str, mode: str, start: int, ranks: int) -> list[str]:
    """The overrides that grow the composed layout (at `start` ranks) along `dim` to `ranks` ranks."""
    p, factor, node = cfg.parallel, ranks // start, cfg.cluster.gpus_per_node
    split = p.tp * p.pp * p.cp
    if start % split:
        raise ScaleError(f"--ranks starts at {start}, fewer than tp*pp*cp = {split} of the composed layout")
    try:
        nodes, per_node = node_shape(ranks, node)
    except ValueError as e:
        raise ScaleError(str(e)) from None
    out = [f"cluster.nodes={nodes}", f"cluster.gpus_per_node={per_node}"]
    if dim in ("tp", "pp"):
        out += [f"parallel.{dim}={getattr(p, dim) * factor}", f"parallel.dp={start // split}"]
    else:
        out.append("parallel.dp=null")
    if dim == "ep":
        out.append(f"parallel.ep={p.ep * factor}")
    # weak: the batch per data-parallel rank stays, so the global batch grows with dp
    batch = cfg.train.global_batch * (factor if dim in ("dp", "ep") and mode == "weak" else 1)
    out.append(f"train.global_batch={batch}")
    if cfg.train.grad_accum is not None:  # derived at every size (strong scaling of dp divides it)
        out.append("train.grad_accum=null")
    return out


def with_overrides(cfg: Config, dotlist: list[str]) -> Config:
    """The composed configuration with these key=value overrides merged in (inside the Hydra app
    that composed it: no second composition)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(dotlist)))


def run_scale(
    cfg: Config,
    user_overrides: list[str],
    dim: str,
    mode: str,
    ranks: tuple[int, int],
    threshold: float,
    sweep_dir: Path,
    opts: SweepOptions,
) -> list[dict]:
    """Measure the curve; [row per size]. The composed layout's tp, pp and global batch are its
    start; ranks fill nodes of the composed cluster's gpus_per_node."""
    # every size's overrides first, and every point validated: a ScaleError before any run
    planned = {size: point_overrides(cfg, dim, mode, ranks[0], size) for size in sizes(*ranks)}
    invalid = {size: validate(with_overrides(cfg, mine)).errors for size, mine in planned.items()}
    if listing := [f"  {size} ranks: {e}" for size, errors in invalid.items() for e in errors]:
        raise ScaleError(
            f"--dim {dim} over --ranks {ranks[0]}..{ranks[1]} makes points that cannot run; nothing was "
            "started:\n" + "\n".join(listing)
        )
    describe_sweep(sweep_dir, scaling={"dimension": dim, "mode": mode, "threshold": threshold})
    opts.total_points, opts.started = len(planned), time.time()
    rows = []
    for i, size in enumerate(planned, start=1):
        mine = planned[size]
        keys = {o.split("=", 1)[0] for o in mine}
        overrides = [o for o in user_overrides if o.split("=", 1)[0].lstrip("+~") not in keys] + mine
        row = run_point(with_overrides(cfg, mine), overrides, sweep_dir / point_dir(overrides), sweep_dir, opts)
        print(progress_line(row, i, opts), flush=True)
        rows.append(row)
    return rows


def scaling_table(rows: list[dict], threshold: float) -> str:
    """The curve, one line per size, and the verdict; a point that did not finish (its partial
    figures are in its line) is on no doubling, as in `parakit report`."""
    lines = [f"{'ranks':>6}{'layout':>22}{'tokens/s':>12}{'predicted':>12}{'gain':>8}{'efficiency':>12}  status"]
    finished = [r for r in rows if r.get("status") == "ok"]
    gains = {d.to_ranks: d for d in doublings(finished, threshold)}
    for r in sorted(rows, key=lambda r: r.get("world_size") or 0):
        shape = f"tp={r.get('tp')} pp={r.get('pp')} dp={r.get('dp')}"
        step = gains.get(r.get("world_size"))
        measured = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        predicted = f"{r['predicted_tokens_per_s']:,.0f}" if r.get("predicted_tokens_per_s") else "-"
        gain = f"{step.gain:.2f}x" if step else ""
        efficiency = f"{step.efficiency:.0%}" if step else ""
        lines.append(
            f"{r.get('world_size') or '-':>6}{shape:>22}{measured:>12}{predicted:>12}{gain:>8}{efficiency:>12}"
            f"  {r['status']}"
        )
    line = verdict(finished, threshold)
    stop = first_below(doublings(finished, threshold)) is not None
    lines.append(f"\n{line}" + (": scale no further along this dimension" if stop else ""))
    return "\n".join(lines)


def scale_command(cfg: Config, opts, user_overrides: list[str]) -> int:
    import sys

    try:
        ranks = parse_range(opts.ranks)
        sweep_dir = Path(opts.sweep_dir or f"scale/{as_name(cfg.model.name)}-{opts.dim}-{opts.mode}")
        sweep = SweepOptions(opts.warmup_steps, opts.timeout)
        read_rows(sweep_dir)  # a damaged record is named before any point trains
        print(f"{opts.mode} scaling of {opts.dim} over {opts.ranks} ranks in {sweep_dir}:", flush=True)
        run_scale(cfg, user_overrides, opts.dim, opts.mode, ranks, opts.threshold, sweep_dir, sweep)
    except (ScaleError, SweepRecordError) as e:
        print(f"parakit scale: {e}", file=sys.stderr)
        return 1
    print(scaling_table(read_rows(sweep_dir), opts.threshold))
    print(f"draw it: parakit report {sweep_dir}")
    return 0
