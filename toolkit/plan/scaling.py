"""`plan --scaling A..B`: the planner's scaling curve to any size, beside a measured small one.

At each power-of-two GPU count the cluster is resized (whole nodes of the cluster's
gpus_per_node once past one node) and the best layout the search finds is taken; weak scaling
grows the global batch with the GPUs (the batch per GPU stays), strong scaling keeps it. The
gain of each doubling is judged as a measured curve is (toolkit/plan/doublings.py).
"""

from __future__ import annotations

import dataclasses

from toolkit.config.schema import Config
from toolkit.plan.doublings import doublings, verdict
from toolkit.plan.layout import world_size
from toolkit.plan.search import search


def node_shape(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, GPUs per node) of `gpus` GPUs: part of one node, else whole nodes. A size that does not
    fill whole nodes is a ValueError: rounded, it would be another size under this one's name."""
    if gpus > gpus_per_node and gpus % gpus_per_node:
        largest = 1 << (gpus_per_node.bit_length() - 1)
        raise ValueError(
            f"{gpus} ranks do not fill whole nodes of cluster.gpus_per_node={gpus_per_node}. Fix: end the range "
            f"at {largest}, or use a cluster whose gpus_per_node is a power of two"
        )
    return max(1, gpus // gpus_per_node), min(gpus, gpus_per_node)


def sizes(low: int, high: int) -> list[int]:
    """The powers of two from low to high."""
    return [low << i for i in range((high // low).bit_length())]


def resized(cfg: Config, gpus: int, mode: str) -> Config:
    nodes, per_node = node_shape(gpus, cfg.cluster.gpus_per_node)
    cluster = dataclasses.replace(cfg.cluster, nodes=nodes, gpus_per_node=per_node)
    batch = cfg.train.global_batch
    if mode == "weak":
        batch = max(1, batch * gpus // world_size(cfg))
    train = dataclasses.replace(cfg.train, global_batch=batch, grad_accum=None)
    return dataclasses.replace(cfg, cluster=cluster, train=train, parallel=dataclasses.replace(cfg.parallel, dp=None))


def predicted_curve(cfg: Config, low: int, high: int, mode: str) -> list[dict]:
    """One row per size: the best layout's shape and figures (no row figures where none fits). A
    size that does not fill whole nodes is a ValueError before any is planned."""
    rows = []
    resized_all = {gpus: resized(cfg, gpus, mode) for gpus in sizes(low, high)}  # a ValueError before any search
    for gpus, sized in resized_all.items():
        best = next(iter(search(sized).ranked), None)
        row = {"world_size": gpus, "global_batch": sized.train.global_batch}
        if best:
            lay = best.layout
            row |= {
                "layout": f"{lay.dims.label()} mb={lay.micro_batch} zero={best.cfg.zero.stage}",
                "tokens_per_s": best.step.tokens_per_s,
                "mfu": best.step.mfu,
            }
        rows.append(row)
    return rows


def curve_table(rows: list[dict], threshold: float) -> str:
    steps = {d.to_ranks: d for d in doublings(rows, threshold)}
    lines = [f"{'GPUs':>7}{'global batch':>14}  {'best layout':<44}{'tokens/s':>14}{'MFU':>7}{'gain':>8}{'eff.':>6}"]
    for r in rows:
        d = steps.get(r["world_size"])
        if "tokens_per_s" not in r:
            lines.append(f"{r['world_size']:>7}{r['global_batch']:>14}  no layout fits or divides the batch")
            continue
        gain = f"{d.gain:.2f}x" if d else ""
        eff = f"{d.efficiency:.0%}" if d else ""
        lines.append(
            f"{r['world_size']:>7}{r['global_batch']:>14}  {r['layout']:<44}{r['tokens_per_s']:>14,.0f}"
            f"{r['mfu']:>7.1%}{gain:>8}{eff:>6}"
        )
    lines.append(f"predicted: {verdict(rows, threshold, unit='GPUs')}")
    return "\n".join(lines)
