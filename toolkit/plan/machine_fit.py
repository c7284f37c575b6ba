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
- GPUs (gpu_constants): the datasheet's peak stays; gemm_efficiency is what makes the planner's
  GPU GEMM (kernels.gemm_time: tile and wave quantization over the measured SM count, the
  output's store) take the measured times of the model's GEMMs and a large square one. HBM:
  STREAM's triad (a = b + q*c, 3 arrays moved). NCCL's collectives fitted to the same ring, each
  row's bytes the whole collective's (nccl_groups), as the planner passes them.

Pure arithmetic (numpy and scipy), no torch.
"""

from __future__ import annotations

import math
import statistics

from toolkit.plan.collectives import COLLECTIVE_EFFICIENCY
from toolkit.plan.kernels import gemm_time, shape_efficiency
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
        "checkpoint_write_gbs_per_node": raw["write"]["bytes"] / raw["write"]["seconds"] / 1e9,
    }


def stack_overrides(backend: str, layers: int, vocab: int, tp: int = 1, cluster: list[str] | None = None) -> list[str]:
    """`tp` ranks (one model replica), the tiny model, two micro-batches of 2 x 128 tokens, ZeRO-1;
    on this machine's CPU cluster in fp32, or on the cluster and precision `cluster` overrides
    give (the GPU probe: its datasheet file, bf16)."""
    return [
        *(cluster or ["precision=fp32"]),
        f"backend={backend}",
        "model=tiny",
        f"model.num_layers={layers}",
        f"model.vocab_size={vocab}",
        "data=synthetic",
        f"cluster.gpus_per_node={tp}",
        "parallel=dp",
        f"parallel.tp={tp}",
        "zero='1'",
        "train.global_batch=4",
        "train.micro_batch=2",
        "train.steps=100",
        "optim.warmup_steps=0",
    ]


def fit_stack(
    backend: str, seconds: list[float], constants: dict[str, float], cluster: list[str] | None = None
) -> dict[str, float]:
    """The backend's StackCosts from the measured step seconds of STACK_POINTS (and, where it has
    tensor parallel, of the second point at tp=2), given the cluster constants fitted before:
    what the planner, without stack costs, leaves unexplained. `cluster`: the overrides the
    points ran with (stack_overrides)."""
    import dataclasses

    from toolkit.config.store import compose_config
    from toolkit.plan.layout import resolve

    points = [(*p, 1) for p in STACK_POINTS] + [(*STACK_POINTS[1], 2)] * (len(seconds) > len(STACK_POINTS))
    predicted, sizes = [], []
    for layers, vocab, tp in points:
        cfg = compose_config(stack_overrides(backend, layers, vocab, tp, cluster))
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


# --- GPUs (toolkit.train.machine_probe.probe_gpu) ---------------------------------------------


def fit_gemm_efficiency(rows: list[list[float]], cluster, peak: float, out_bytes: int = 2) -> float:
    """The gemm_efficiency at which the planner's GPU GEMM (kernels.gemm_time: the tile- and
    wave-quantized rate of `cluster.sm_count` SMs, plus the output's store through HBM) takes the
    measured [M, N, K, seconds] rows' times: least squares on log time, against `peak` FLOP/s."""

    def residuals(x):
        (efficiency,) = x
        return [math.log(gemm_time(cluster, m, n, k, peak * efficiency, out_bytes) / t) for m, n, k, t in rows]

    return _least_squares(residuals, [0.7])[0]


def nccl_groups(groups: dict[str, dict[str, list[list[float]]]]) -> dict[str, dict[str, list[list[float]]]]:
    """The collectives' rows with each row's bytes the whole collective's, as the planner's ring_time
    takes them (and nccl-tests' "size": an all-gather's output, a reduce-scatter's input): the probe
    records each rank's tensor, which for these two is one of the group's `size` shards."""
    return {
        size: {
            kind: [[b * (int(size) if kind in ("all_gather", "reduce_scatter") else 1), t] for b, t in rows]
            for kind, rows in kinds.items()
        }
        for size, kinds in groups.items()
    }


def bus_bandwidth(kind: str, nbytes: float, group: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth (doc/PERFORMANCE.md) of a collective of `nbytes` (its whole size):
    algbw = size / time, times 2(n-1)/n for an all-reduce, (n-1)/n for an all-gather or a
    reduce-scatter: what each link carried, comparable with the hardware's bandwidth."""
    return nbytes / seconds * RING_FACTORS[kind] * (group - 1) / group


def gpu_constants(raw: dict, datasheet, measured_peaks: bool = False) -> dict:
    """The ClusterConfig fields a GPU probe's raw figures give, against the `datasheet` cluster
    (its peaks and gemm_half_size): the median over the node's GPUs of each compute figure, rank
    0's collectives. `measured_peaks` (a GPU no datasheet describes): the peaks are the square
    GEMMs' measured rates."""
    from types import SimpleNamespace

    ranks, gpu = raw["per_rank"], raw["gpu"]
    hbm = statistics.median(b / t for b, t in (r["triad"] for r in ranks))
    square = [2 * m * n * k / t for m, n, k, t in (r["gemm_bf16"][-1] for r in ranks)]
    out: dict = {}
    peak = datasheet.peak_tflops_bf16 * 1e12
    if measured_peaks or not peak:
        peak = statistics.median(square)
        fp32 = statistics.median(2 * m * n * k / t for m, n, k, t in (r["square_fp32"] for r in ranks))
        out |= {"peak_tflops_bf16": peak / 1e12, "peak_tflops_fp16": peak / 1e12, "peak_tflops_fp32": fp32 / 1e12}
        out |= {"peak_tflops_fp8": 0.0, "gpu_memory_gb": gpu["memory_gb"]}
    model = SimpleNamespace(
        sm_count=gpu["sm_count"], gemm_half_size=datasheet.gemm_half_size, hbm_bandwidth_gbs=hbm / 1e9
    )
    out |= {
        "gemm_efficiency": statistics.median(fit_gemm_efficiency(r["gemm_bf16"], model, peak) for r in ranks),
        "sm_count": gpu["sm_count"],
        "hbm_bandwidth_gbs": hbm / 1e9,
        "op_dispatch_s": statistics.median(r["dispatch"]["autograd_s"] for r in ranks),
        "transformer_engine": bool(raw["transformer_engine"]),
        "checkpoint_write_gbs_per_node": raw["write"]["bytes"] / raw["write"]["seconds"] / 1e9,
    }
    if len(ranks) >= 2:  # the node's chips, fastest to slowest, as a fraction of their median
        out["gemm_chip_spread"] = (max(square) - min(square)) / statistics.median(square)
    collectives = ranks[0].get("collectives")
    if collectives:
        groups = nccl_groups(collectives)
        bandwidth, latency = fit_collectives(groups)
        out |= {"intra_node_bandwidth_gbs": bandwidth / 1e9, "collective_latency_s": latency}
        pairs = groups.get(str(len(ranks)), {}).get("send_recv")
        if pairs:
            p2p_bandwidth, p2p_latency = fit_p2p(pairs)
            out |= {"p2p_bandwidth_gbs": p2p_bandwidth / 1e9, "p2p_latency_s": p2p_latency}
    return out
