"""The cluster constants a probe's raw measurements imply (toolkit/train/machine_probe.py measures).

Each constant is fitted to the planner's own formula for it (toolkit/plan/perf.py), so that the
planner, given the constants, reproduces the measured times:
- GEMM: t = 2MNK / (peak * shape_efficiency(half; M, N, K)); peak and half size by least squares
  on log time over the grid. On CPU the "peak" is the large-GEMM rate one thread measured
  (gemm_efficiency 1): there is no vendor figure to divide by.
- Streaming: device-memory bandwidth = bytes / time of out = a + b over tensors too large for the
  caches (the STREAM add kernel, McCalpin 1995). Fresh memory: a tensor above the allocator's
  reuse threshold is new pages each time (glibc's malloc maps it afresh: mallopt(3),
  M_MMAP_THRESHOLD, at most 32 MiB by default on 64-bit), and writing it first faults each
  page in: the extra seconds per byte of an out-of-place over an in-place add.
- The software stack, per backend: one rank trains the tiny model at a few sizes (STACK_POINTS);
  what its step takes beyond the planner's work model, per layer, per logit of the loss and per
  step, are the backend's StackCosts (differences of two points each: exact, no search).
- Collectives: the alpha-beta model of a ring (Thakur, Rabenseifner & Gropp 2005, "Optimization
  of Collective Communication Operations in MPICH", section 4): an all-reduce over g ranks takes
  2(g-1) steps of latency alpha and moves 2(g-1)/g of the bytes; all-gather and reduce-scatter
  half of that; a point-to-point send one step and all the bytes.

Pure arithmetic (numpy and scipy), no torch.
"""

from __future__ import annotations

import math
import statistics

from toolkit.plan.collectives import COLLECTIVE_EFFICIENCY
from toolkit.plan.kernels import shape_efficiency
from toolkit.plan.perf import estimate_step

# (layers, vocabulary) of the stack probe's runs: the first is the base, the second adds layers,
# the third adds logits (30720 x 256 tokens x 4 bytes stays under FRESH_BYTES: fresh pages are
# the fresh-memory constant's).
STACK_POINTS = ((2, 1024), (10, 1024), (2, 30720))
# What a collective of each kind is to the ring model: (steps per (g-1), share of the bytes per (g-1)/g).
RING_FACTORS = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}
# Tensors at least this large are above glibc's largest mmap threshold (32 MiB, mallopt(3)).
FRESH_BYTES = 32 * 2**20


def _least_squares(residuals, start: list[float]) -> list[float]:
    import numpy as np
    from scipy.optimize import least_squares

    return list(map(float, np.exp(least_squares(lambda x: residuals(np.exp(x)), np.log(start)).x)))


def fit_gemm(rows: list[list[float]]) -> tuple[float, float]:
    """(peak FLOP/s, half size) from [M, N, K, seconds] rows."""

    def residuals(x):
        peak, half = x
        return [math.log(2 * m * n * k / (peak * shape_efficiency(half, m, n, k)) / t) for m, n, k, t in rows]

    best = max(2 * m * n * k / t for m, n, k, t in rows)
    peak, half = _least_squares(residuals, [best, 16.0])
    return peak, half


def fit_peak(rows: list[list[float]], half: float) -> float:
    """The peak FLOP/s of another dtype's rows at a known half size (geometric mean of the rows)."""
    logs = [math.log(2 * m * n * k / (shape_efficiency(half, m, n, k) * t)) for m, n, k, t in rows]
    return math.exp(statistics.fmean(logs))


def fit_stream(rows: list[list[float]]) -> tuple[float, float]:
    """(bandwidth, fresh-memory bandwidth), bytes/s, from [bytes, seconds in place, seconds fresh]:
    the largest tensors (beyond the caches, above the mmap threshold)."""
    large = [r for r in rows if r[0] / 3 >= FRESH_BYTES] or rows[-1:]
    bandwidth = statistics.median(b / t for b, t, _ in large)
    # the fresh output is a third of the bytes moved (a + b -> out)
    fresh = statistics.median((b / 3) / max(f - t, 1e-9) for b, t, f in large)
    return bandwidth, fresh


def ring_time(kind: str, nbytes: float, group: int, bandwidth: float, latency: float) -> float:
    """The alpha-beta ring time of one collective (bandwidth in bytes/s as the planner divides it:
    after COLLECTIVE_EFFICIENCY)."""
    if kind == "send_recv":
        return latency + nbytes / (bandwidth * COLLECTIVE_EFFICIENCY)
    factor = RING_FACTORS[kind]
    return factor * (group - 1) * latency + factor * (group - 1) / group * nbytes / (bandwidth * COLLECTIVE_EFFICIENCY)


def fit_collectives(groups: dict[str, dict[str, list[list[float]]]]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s per ring step) from group size -> kind -> [bytes, seconds]."""
    rows = [(kind, int(size), b, t) for size, kinds in groups.items() for kind, rs in kinds.items() for b, t in rs]
    rows = [r for r in rows if r[0] != "send_recv"]

    def residuals(x):
        bandwidth, latency = x
        return [math.log(ring_time(k, b, g, bandwidth, latency) / t) for k, g, b, t in rows]

    return tuple(_least_squares(residuals, [1e9, 1e-4]))


def fit_p2p(rows: list[list[float]]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of point-to-point sends from [bytes, seconds] rows."""

    def residuals(x):
        bandwidth, latency = x
        return [math.log(ring_time("send_recv", b, 2, bandwidth, latency) / t) for b, t in rows]

    return tuple(_least_squares(residuals, [1e9, 1e-4]))


def cluster_constants(raw: dict) -> dict[str, float]:
    """The ClusterConfig fields a probe's raw figures give (the median over the compute ranks of
    each compute figure; rank 0's collectives)."""
    ranks = raw["per_rank"][: raw["compute_ranks"]]
    gemm = [fit_gemm(r["gemm_fp32"]) for r in ranks]
    peak, half = statistics.median(g[0] for g in gemm), statistics.median(g[1] for g in gemm)
    bf16 = statistics.median(fit_peak(r["gemm_bf16"], half) for r in ranks)
    streams = [fit_stream(r["stream"]) for r in ranks]
    collectives = raw["per_rank"][0]["collectives"]
    bandwidth, latency = fit_collectives(collectives)
    p2p_bandwidth, p2p_latency = fit_p2p(collectives[str(raw["ranks"])]["send_recv"])
    return {
        "peak_tflops_fp32": peak / 1e12,
        "peak_tflops_bf16": bf16 / 1e12,
        "gemm_efficiency": 1.0,
        "gemm_half_size": half,
        "hbm_bandwidth_gbs": statistics.median(s[0] for s in streams) / 1e9,
        "fresh_memory_gbs": statistics.median(s[1] for s in streams) / 1e9,
        "intra_node_bandwidth_gbs": bandwidth / 1e9,
        "collective_latency_s": latency,
        "p2p_bandwidth_gbs": p2p_bandwidth / 1e9,
        "p2p_latency_s": p2p_latency,
    }


def stack_overrides(backend: str, layers: int, vocab: int, tp: int = 1) -> list[str]:
    """`tp` ranks (one model replica), the tiny model, two micro-batches of 2 x 128 tokens, fp32, ZeRO-1."""
    return [
        f"backend={backend}",
        "model=tiny",
        f"model.num_layers={layers}",
        f"model.vocab_size={vocab}",
        "data=synthetic",
        f"cluster.gpus_per_node={tp}",
        "parallel=dp",
        f"parallel.tp={tp}",
        "zero='1'",
        "precision=fp32",
        "train.global_batch=4",
        "train.micro_batch=2",
        "train.steps=100",
        "optim.warmup_steps=0",
    ]


def fit_stack(backend: str, seconds: list[float], constants: dict[str, float]) -> dict[str, float]:
    """The backend's StackCosts from the measured step seconds of STACK_POINTS (and, where it has
    tensor parallel, of the second point at tp=2), given the cluster constants fitted before:
    what the planner, without stack costs, leaves unexplained."""
    import dataclasses

    from toolkit.config.store import compose_config
    from toolkit.plan.layout import resolve

    points = [(*p, 1) for p in STACK_POINTS] + [(*STACK_POINTS[1], 2)] * (len(seconds) > len(STACK_POINTS))
    predicted, sizes = [], []
    for layers, vocab, tp in points:
        cfg = compose_config(stack_overrides(backend, layers, vocab, tp))
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, **constants, stack={}))
        layout = resolve(cfg)
        predicted.append(estimate_step(cfg, layout).step_time)
        logits = layout.micro_batch * layout.seq_length * layout.padded_vocab_size / tp
        sizes.append((layers * layout.num_microbatches, logits * layout.num_microbatches))
    unexplained = [t - p for t, p in zip(seconds, predicted)]
    layer = max(0.0, (unexplained[1] - unexplained[0]) / (sizes[1][0] - sizes[0][0]))
    logit = max(0.0, (unexplained[2] - unexplained[0]) / (sizes[2][1] - sizes[0][1]))
    step = max(0.0, unexplained[0] - layer * sizes[0][0] - logit * sizes[0][1])
    costs = {"layer_s": layer, "loss_s_per_logit": logit, "step_s": step, "tp_layer_s": 0.0}
    if len(unexplained) > 3:  # what a tensor-parallel layer costs beyond its modelled collectives
        explained = layer * sizes[3][0] + logit * sizes[3][1] + step
        costs["tp_layer_s"] = max(0.0, (unexplained[3] - explained) / sizes[3][0])
    return costs
