"""Step time, throughput and MFU of a layout, from FLOPs, bandwidths and the schedule.

Compute: each GEMM at the cluster's large-GEMM efficiency, reduced by its shapes: on GPUs by tile
and wave quantization of its output over the SMs, plus the store of its output through HBM
(`gemm_time`: forward and the two backward GEMMs each with their own shapes); on CPU by the
saturation curve `parakit probe` fits (`shape_efficiency`). Flash attention at
ATTENTION_EFFICIENCY of the GEMM rate; unfused GPU attention as batched GEMMs at their roofline
plus softmax and dropout passes; memory-bound element-wise work (norms, activations, residuals)
as bytes over HBM bandwidth.
Tensor parallel: per layer and micro-batch, 2 all-reduces forward and 2 backward (or the same
volume as all-gather + reduce-scatter with sequence parallel) of b*s*h values (Narayanan et al.
2021, section 3.3; Korthikanti et al. 2022, section 4.2.2), exposed unless parallel.tp_comm_overlap hides them under the
layer's GEMMs; on CPU (gloo) a collective is work of the node's cores, shared with the compute as that is.
Pipeline: (m + (p-1)/v) micro-batch times per step (Narayanan et al. 2021, section 2.2.2) plus
point-to-point sends of b*s*h activations per chunk boundary.
Data parallel: ring reduce-scatter/all-gather, (d-1)/d of the bytes over the slowest link per
GPU (Patarasuk & Yuan 2009); overlapped with the last micro-batch's backward where the backend
overlaps (Megatron overlap_grad_reduce / DeepSpeed overlap_comm; zero.overlap_comm=false turns
it off). ZeRO-3 gathers parameters for
every micro-batch's forward and backward (Rajbhandari et al. 2020, section 7.2.2), prefetched.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
from dataclasses import dataclass

from toolkit.config.schema import Config
from toolkit.plan.backends import Backend, GradReduce, backend_of
from toolkit.plan.flops import step_flops
from toolkit.plan.layout import Layout
from toolkit.plan.memory import DTYPE_BYTES
from toolkit.plan.params import all_stage_params, head_dim, kv_heads

# NCCL reaches about 80% of link bandwidth for large messages (nccl-tests bus bandwidth on
# NVLink and InfiniBand NDR).
COLLECTIVE_EFFICIENCY = 0.8
# glibc's largest dynamic mmap threshold on 64-bit (mallopt(3), DEFAULT_MMAP_THRESHOLD_MAX): a
# tensor at least this large gets fresh pages at every allocation.
FRESH_BYTES = 32 * 2**20
# FlashAttention-2 forward+backward runs at 50-70% of peak where large GEMMs reach ~80%
# (Dao 2023, "FlashAttention-2", section 4.1).
ATTENTION_EFFICIENCY = 0.75
# Communication overlapped with compute still slows it: NCCL kernels occupy SMs and memory
# bandwidth (Jangda et al. 2022, "Breaking the Computation and Communication Abstraction
# Barrier in Distributed Machine Learning Workloads", section 2): charge 20% of the overlap.
OVERLAP_INTERFERENCE = 0.2
# FP8 tensor-core GEMMs held at the power limit reach a slightly smaller fraction of their (2x)
# peak than BF16 ones: cuBLASLt FP8 6144x12288x12288 after 10,000 warm-up iterations runs 1351.4
# (H100) and 1318.0 (H200) of 1979 TFLOP/s, 68.3% and 66.6% (Azure/AI-benchmarking-guide,
# Azure_Results/ND_H100_v5_results.md, ND_H200_v5_results.md), against BF16's sustained 70.6%:
# 0.97 and 0.94. Transformer Engine casts the activations inside the norm or activation kernel
# before each GEMM (LayerNormLinear, LayerNormMLP) and the weights once per step (their FP8 copies
# are kept across micro-batches, is_first_microbatch), so the casts add no pass of their own.
FP8_GEMM_FRACTION = 0.95
# ZeRO-3 prefetches parameters one or two layers ahead: gathers hide under at most half of the
# compute (assumption), and share the link with the gradient reduce-scatters.
ZERO3_OVERLAP = 0.5
# A host (offloaded) Adam updates about 1e9 parameters per second per GPU (DeepSpeed CPU-Adam,
# Ren et al. 2021, "ZeRO-Offload", Table 4 order of magnitude).
HOST_ADAM_PARAMS_PER_S = 1e9


def shape_efficiency(half_size: float, *dims: float) -> float:
    """Fraction of large-GEMM throughput left for a GEMM with these per-GPU dimensions (each
    dimension at `half_size`, the cluster's gemm_half_size, halves it)."""
    eff = 1.0
    for dim in dims:
        eff *= dim / (dim + half_size)
    return eff


# GPU GEMMs: a kernel splits the m x n output into thread-block tiles, one per streaming
# multiprocessor at a time; a partly filled last wave costs a whole one (tile and wave quantization:
# NVIDIA, "Matrix Multiplication Background User's Guide", Dimension Quantization Effects;
# stas00/ml-engineering training/performance/README.md "Tile and wave quantization": C =
# ceil(m/Tm) * ceil(n/Tn) blocks take ceil(C/SMs) waves). The tiles cuBLAS picks from (the
# guide's list, 256x128 and 128x256 the most efficient); the kernel with the least quantization is
# taken, at the same per-tile rate (an optimistic bound for the smaller tiles).
GEMM_TILES = ((128, 256), (256, 128), (128, 128), (64, 256), (256, 64), (128, 64), (64, 128))


def wave_efficiency(m: float, n: float, sms: int) -> float:
    """Useful share of the tiles a GPU GEMM with an m x n output runs: its area over the tiles of
    the waves it needs, with the best of GEMM_TILES."""
    best = 0.0
    for tm, tn in GEMM_TILES:
        waves = math.ceil(math.ceil(m / tm) * math.ceil(n / tn) / sms)
        best = max(best, m * n / (waves * sms * tm * tn))
    return best


# Expected range of 8 samples of a standard normal distribution (Tippett 1925, "On the extreme
# individuals and the range of samples taken from a normal population"; the d2 constant of
# control charts, ASTM E2587): turns the spread of one node's 8 GPUs into their standard deviation.
RANGE_OF_EIGHT = 2.847


def slowest_chip_factor(gpus: int, spread: float) -> float:
    """Expected speed of the slowest of `gpus` chips, relative to their mean, where one node's 8
    chips spread over `spread` (a fraction of the mean), chip speeds taken as normal: the expected
    extreme of n normal samples is about inv_cdf((n - 0.375) / (n + 0.25)) standard deviations
    (Blom 1958, "Statistical Estimates and Transformed Beta-Variables"). A synchronous step waits
    on its slowest GPU, so a 16,384-GPU job runs about 3.9 deviations below the mean and one node
    1.4."""
    if gpus <= 1 or spread <= 0:
        return 1.0
    extreme = statistics.NormalDist().inv_cdf((gpus - 0.375) / (gpus + 0.25))
    return 1.0 - spread / RANGE_OF_EIGHT * extreme


def gemm_time(c, m: float, n: float, k: float, flops_per_s: float, out_bytes: int) -> float:
    """Seconds of one (m x k) @ (k x n) GEMM at `flops_per_s` (the device's large-GEMM rate).

    GPUs (cluster.sm_count set): the tile/wave-quantized rate, plus the store of the m x n output
    through HBM, which each tile does after its k-loop (a roofline term, Williams, Waterman &
    Patterson 2009, "Roofline", that is not hidden: 2k FLOPs per output element against out_bytes,
    so a reduction of k costs ridge/k more, ridge = flops_per_s / HBM bytes per second; about 130
    FLOP/B on A100, 240 on H100). Else (CPU) the fitted saturation of `shape_efficiency`."""
    if not c.sm_count:
        return 2 * m * n * k / (flops_per_s * shape_efficiency(c.gemm_half_size, m, n, k))
    compute = 2 * m * n * k / (flops_per_s * wave_efficiency(m, n, c.sm_count))
    return compute + m * n * out_bytes / (c.hbm_bandwidth_gbs * 1e9)


def linear_time(
    c, tokens: float, n: float, k: float, flops_per_s: float, out_bytes: int, grad_bytes: int | None = None
) -> tuple[float, float]:
    """Forward and backward seconds of a linear layer Y = X W with X tokens x k and W k x n. On a
    GPU the backward's two GEMMs have their own shapes: dX = dY W^T (tokens x n @ n x k, a
    reduction of n) and dW = X^T dY (k x tokens @ tokens x n, a reduction over the tokens), whose
    epilogue moves `grad_bytes` per weight (default out_bytes: a 16-bit gradient written; 8 where
    each micro-batch accumulates into an fp32 gradient, read and written). On CPU the backward
    costs twice the forward (as `parakit probe` fits it)."""
    fwd = gemm_time(c, tokens, n, k, flops_per_s, out_bytes)
    if not c.sm_count:
        return fwd, 2 * fwd
    dgrad = gemm_time(c, tokens, k, n, flops_per_s, out_bytes)
    return fwd, dgrad + gemm_time(c, k, n, tokens, flops_per_s, grad_bytes or out_bytes)


def _unfused_attention(scores: float, d: int, flops_per_s: float, hbm: float, nbytes: int, dropout: float):
    """Forward and backward seconds of GPU attention as separate kernels (pre-FlashAttention
    Megatron-LM: baddbmm, fused scale-mask-softmax, dropout, bmm) over the `scores` elements of
    the s x s score matrices. QK^T and AV forward, dP, dV, dQ and dK backward are batched GEMMs
    whose reduction is only the head dimension d: each runs at the roofline (Williams et al. 2009)
    of its 2*d FLOPs and its pass over the scores (d FLOP/B in 16 bits, below the ~130-240 FLOP/B
    ridge of A100/H100: memory-bound). Softmax and dropout are passes through HBM."""
    gemm = max(2 * scores * d / flops_per_s, scores * nbytes / hbm)  # one batched GEMM
    drop = dropout > 0
    # forward: softmax reads S and writes P; dropout reads P, writes P' and a 1-byte mask
    fwd = 2 * gemm + (2 * nbytes + drop * (2 * nbytes + 1)) * scores / hbm
    # backward: dropout reads dP' and the mask and writes dP; softmax reads P and dP, writes dS
    bwd = 4 * gemm + (3 * nbytes + drop * (2 * nbytes + 1)) * scores / hbm
    return fwd, bwd


def peak_flops(cfg: Config) -> float:
    c, dtype = cfg.cluster, cfg.precision.dtype
    tflops = {
        "fp32": c.peak_tflops_fp32,
        "bf16": c.peak_tflops_bf16,
        "fp16": c.peak_tflops_fp16,
        "fp8": c.peak_tflops_fp8,
    }[dtype]
    return tflops * 1e12


def mfu_peak_flops(cfg: Config) -> float:
    """MFU's denominator (model FLOPs utilisation, Chowdhery et al. 2022, "PaLM", Appendix B): the
    bf16 peak for fp8 runs (as NeMo and Megatron-LM report), else the dtype's."""
    return cfg.cluster.peak_tflops_bf16 * 1e12 if cfg.precision.dtype == "fp8" else peak_flops(cfg)


def _ring_time(nbytes: float, group: int, bandwidth_gbs: float, factor: float, latency_s: float) -> float:
    """A ring collective in the alpha-beta model (Thakur, Rabenseifner & Gropp 2005, "Optimization of
    Collective Communication Operations in MPICH", section 4): factor*(g-1) steps of latency, and
    factor*(g-1)/g of nbytes per GPU over the link (factor 2 for all-reduce, 1 for all-gather and
    reduce-scatter)."""
    if group <= 1:
        return 0.0
    wire = factor * (group - 1) / group * nbytes / (bandwidth_gbs * 1e9 * COLLECTIVE_EFFICIENCY)
    return factor * (group - 1) * latency_s + wire


def _p2p_time(cfg: Config, nbytes: float, link_gbs: float) -> float:
    """One point-to-point send of nbytes: the cluster's p2p latency, over its p2p bandwidth (the
    link's where none is given)."""
    bandwidth = cfg.cluster.p2p_bandwidth_gbs or link_gbs
    return cfg.cluster.p2p_latency_s + nbytes / (bandwidth * 1e9 * COLLECTIVE_EFFICIENCY)


def _fresh_time(cfg: Config, nbytes: float) -> float:
    """Seconds a new tensor of nbytes costs beyond its writes where the allocator maps it afresh
    (CPU: glibc's malloc maps blocks over FRESH_BYTES with mmap, mallopt(3), and every page faults
    in on first write); 0 where allocations reuse memory (the GPU caching allocator)."""
    fresh = cfg.cluster.fresh_memory_gbs
    return nbytes / (fresh * 1e9) if fresh and nbytes >= FRESH_BYTES else 0.0


@dataclass(frozen=True)
class StepEstimate:
    step_time: float
    compute: float  # pipeline compute incl. the bubble and exposed TP comm
    bubble: float
    tp_comm: float
    pp_comm: float
    dp_comm: float  # exposed data-parallel / ZeRO communication
    optimizer: float
    tokens_per_s: float
    tflops_per_gpu: float  # model TFLOP/s per GPU
    mfu: float
    hfu: float
    # One micro-batch's forward and backward on each pipeline stage (the last adds the logits):
    # how even the stages are decides the pipeline's pace (the slowest one sets it).
    stage_times: tuple[float, ...] = ()

    @property
    def comm_share(self) -> float:
        return (self.tp_comm + self.pp_comm + self.dp_comm) / self.step_time


def _overlapped(comm: float, window: float) -> float:
    """Time a communication adds when it may hide under `window` seconds of compute."""
    hidden = min(comm, max(window, 0.0))
    return comm - hidden + OVERLAP_INTERFERENCE * hidden


def _elementwise_bytes(m, tokens: int, tp: int, sp: bool, nbytes: int) -> float:
    """Bytes element-wise ops move per layer and micro-batch, forward and backward (x3)."""
    h, d = m.hidden_size, head_dim(m)
    q, kv = m.num_attention_heads * d, kv_heads(m) * d
    ffn_in = m.ffn_hidden_size * (2 if m.activation == "swiglu" else 1)
    replicated = 10 * h / (tp if sp else 1)  # 2 norms (read + write), 2 residual adds (2 reads + write)
    sharded = (2 * (q + kv) + ffn_in + m.ffn_hidden_size) / tp  # RoPE on q, k; activation in -> out
    return 3 * tokens * (replicated + sharded) * nbytes


def _spans_nodes(cfg: Config, group_size: int, stride: int) -> bool:
    return group_size > 1 and group_size * stride > cfg.cluster.gpus_per_node


def _core_sharing(cfg: Config, layout: Layout, stage_times: list[float], step_s: float) -> float:
    """How much slower compute runs on an oversubscribed CPU node (>= 1; 1 on GPUs): the step
    cannot end before the node's cores have done every rank's work (its gloo collectives
    included). A rank waiting for its pipeline peers leaves its core to the others, so the slowdown
    is the node's CPU work over its cores, against the step's unshared critical path (the slowest
    stage's micro-batches, the bubble and the per-step work)."""
    c = cfg.cluster
    if c.device != "cpu":
        return 1.0
    cores = c.cores_per_node or os.cpu_count() or 1
    mb, pp = layout.num_microbatches, layout.pp
    critical = (mb + (pp - 1) / layout.vpp) * max(stage_times) + step_s
    node_ranks = min(layout.world_size, c.gpus_per_node)
    work = node_ranks * (mb * sum(stage_times) / pp + step_s)  # ranks are spread evenly over the stages
    return max(1.0, work / cores / critical)


def estimate_step(cfg: Config, layout: Layout, backend: Backend | None = None) -> StepEstimate:
    """Predicted time of one optimizer step of `layout` (compute, tensor/pipeline/data-parallel
    communication, the pipeline bubble, the optimizer), and the throughput and MFU that follow.
    `backend`: the description to price it with (default: the configuration's backend)."""
    m, c, p = cfg.model, cfg.cluster, cfg.parallel
    backend = backend or backend_of(cfg)
    tp, pp, vpp, cp, dp = layout.tp, layout.pp, layout.vpp, layout.cp, layout.dp
    nbytes = DTYPE_BYTES[cfg.precision.dtype]
    efficiency = c.gemm_efficiency * slowest_chip_factor(layout.world_size, c.gemm_chip_spread)
    peak = peak_flops(cfg) * efficiency * (FP8_GEMM_FRACTION if cfg.precision.dtype == "fp8" else 1.0)
    core_peak = (peak_flops(cfg) if cfg.precision.dtype != "fp8" else c.peak_tflops_bf16 * 1e12) * efficiency
    hbm = c.hbm_bandwidth_gbs * 1e9
    seq = layout.seq_length
    tokens = layout.micro_batch * seq // cp  # tokens per micro-batch on one GPU
    h, d = m.hidden_size, head_dim(m)
    q, kv = m.num_attention_heads * d, kv_heads(m) * d
    ffn_in = m.ffn_hidden_size * (2 if m.activation == "swiglu" else 1)
    recompute = cfg.recompute.granularity
    ring = functools.partial(_ring_time, latency_s=c.collective_latency_s)

    # --- one layer, one micro-batch, forward GEMMs on one TP rank
    gemms = [((q + 2 * kv) / tp, h), (h, q / tp), (ffn_in / tp, h), (h, m.ffn_hidden_size / tp)]  # (N, K)
    # Megatron keeps fp32 main_grad buffers and adds each micro-batch's weight gradient into them in
    # the wgrad GEMM's epilogue (Megatron-LM gradient_accumulation_fusion, Transformer Engine
    # fuse_wgrad_accumulation): every weight's fp32 gradient is read and written per micro-batch.
    # (parakit's own megatron runs leave the fusion off, toolkit.emit.megatron: a separate add
    # moves a little more.)
    wgrad_bytes = 8 if backend.fp32_grads_from_stage == 0 else nbytes
    times = [linear_time(c, tokens, n, k, peak, nbytes, wgrad_bytes) for n, k in gemms]
    gemm_fwd = sum(f for f, _ in times)
    gemm_bwd = sum(b for _, b in times)
    heads = m.num_attention_heads / tp
    if cfg.train.attention_backend == "flash":  # skips the masked half of the causal scores
        block = seq / (2 * cp) if cp > 1 else tokens  # context parallel attends in 2*cp chunks
        attention_peak = core_peak * ATTENTION_EFFICIENCY * shape_efficiency(c.gemm_half_size, block, d)
        core_fwd = 2 * 2 * tokens * seq * (q / tp) * 0.5 / attention_peak
        core_bwd = 2 * core_fwd
    elif c.sm_count:
        core_fwd, core_bwd = _unfused_attention(heads * tokens * seq, d, core_peak, hbm, nbytes, m.attention_dropout)
    else:  # batched GEMMs per head over all s^2 scores, softmax through HBM (2 passes fwd, 3 bwd / 3)
        core_fwd = 2 * 2 * tokens * seq * (q / tp) / (core_peak * shape_efficiency(c.gemm_half_size, seq, seq, d))
        core_fwd += 5 / 3 * heads * tokens * seq * nbytes / hbm
        core_bwd = 2 * core_fwd
    elementwise = backend.elementwise_traffic * _elementwise_bytes(m, tokens, tp, p.sequence_parallel, nbytes) / hbm
    tp_bw = c.intra_node_bandwidth_gbs if tp <= c.gpus_per_node else c.inter_node_bandwidth_gbs
    tp_collective = ring(tokens * h * nbytes, tp, tp_bw, 2.0)
    collectives = 4 + (2 if recompute == "full" else 0)
    stack = c.stack.get(backend.name)  # measured costs of the software stack (`parakit probe`)
    # A layer's compute (which shares a CPU node's cores) and its communication (which waits)
    layer = gemm_fwd + gemm_bwd + core_fwd + core_bwd + elementwise + c.layer_overhead_s
    layer += (stack.layer_s + (stack.tp_layer_s if tp > 1 else 0.0)) if stack else 0.0
    tp_layer = collectives * tp_collective
    if p.tp_comm_overlap:  # Transformer Engine's userbuffers split each GEMM and exchange the chunks
        # of its all-gather / reduce-scatter while the other chunks compute (megatron-core
        # tp_comm_overlap; Wang et al. 2023, "Overlap Communication with Dependent Computation via
        # Decomposition in Large Deep Learning Models", section 3): hidden up to the layer's GEMMs
        tp_layer = _overlapped(tp_layer, gemm_fwd * (2 if recompute == "full" else 1) + gemm_bwd)
    layer_comm = tp_layer
    if recompute == "full":
        layer += gemm_fwd + core_fwd + elementwise / 3
    elif recompute == "selective":
        layer += core_fwd
    if cp > 1:  # every rank receives the other ranks' K and V (one pass: an all-gather's volume)
        cp_bw = c.inter_node_bandwidth_gbs if _spans_nodes(cfg, cp, tp) else c.intra_node_bandwidth_gbs
        kv_pass = ring(cp * tokens * 2 * kv / tp * nbytes, cp, cp_bw, 1.0)
        if c.device == "cpu":  # toolkit.train's SdpaAttention: K/V all-gathered once (autograd keeps
            # them), their gradients reduce-scattered
            layer_comm += 2 * kv_pass
        elif p.cp_comm_type == "all_gather":  # Transformer Engine gathers K/V again for the backward
            # and reduce-scatters dK/dV, all exposed (AttnFuncWithCPAndKVAllGather; Llama 3, section 3.3.2)
            layer_comm += 3 * kv_pass
        else:  # the ring: K/V forward, K/V and dK/dV backward, each step's sends hidden under the
            # attention of the step before (Megatron context parallel, Liu et al. 2023 "Ring Attention")
            layer_comm += _overlapped(3 * kv_pass, core_fwd + core_bwd)

    # --- per micro-batch on the slowest stage (the last one adds the logits)
    vocab_shard = layout.padded_vocab_size / tp
    logit_bytes = tokens * vocab_shard * 4  # the loss is computed in fp32
    logits = (
        sum(linear_time(c, tokens, vocab_shard, h, peak, nbytes, wgrad_bytes))
        + (stack.loss_s_per_logit * logit_bytes / 4 if stack else backend.loss_logit_passes * logit_bytes / hbm)
        + backend.loss_fresh_logits * _fresh_time(cfg, logit_bytes)
    )
    logits_comm = 3 * ring(tokens * 4, tp, tp_bw, 2.0)  # the vocab-parallel loss's max, target logit, sum
    work = [n * layer for n in layout.stage_layers]
    work[-1] += logits
    step_s = stack.step_s if stack else 0.0
    comm = [n * layer_comm for n in layout.stage_layers]
    comm[-1] += logits_comm
    if c.device == "cpu":  # gloo's collectives are the cores' own work: copies through loopback
        # sockets by the ranks' threads (gloo/transport/tcp), not a network card's
        work, comm = [t + m for t, m in zip(work, comm)], [0.0] * pp
    sharing = _core_sharing(cfg, layout, work, step_s)
    stage_times = [t * sharing + m for t, m in zip(work, comm)]
    slowest = max(range(pp), key=stage_times.__getitem__)
    per_microbatch = stage_times[slowest]
    tp_per_microbatch = layout.stage_layers[slowest] * tp_layer

    num_mb = layout.num_microbatches
    bubble = (pp - 1) / vpp * per_microbatch
    compute = num_mb * per_microbatch + bubble

    # --- pipeline point-to-point: activations forward, gradients backward, per chunk boundary;
    # under sequence parallel each GPU sends its seq/tp share (megatron-core
    # pipeline_parallel/schedules.py, get_tensor_shapes)
    pp_comm = 0.0
    if pp > 1:
        pp_bw = c.inter_node_bandwidth_gbs if _spans_nodes(cfg, pp, tp * cp * dp) else c.intra_node_bandwidth_gbs
        sent = tokens // (tp if p.sequence_parallel else 1) * h * nbytes
        pp_comm = num_mb * vpp * 2 * _p2p_time(cfg, sent, pp_bw)
        if vpp > 1 and c.device == "cuda":  # megatron-core overlap_p2p_comm (toolkit.emit.megatron)
            # Sends of the steady state wait under the next chunk's compute; those of the warm-up
            # and the flush wait alone (overlap_p2p_comm_warmup_flush off). The first stage warms
            # up the most chunks: 2 (pp - 1) + (vpp - 1) pp (megatron-core pipeline_parallel/
            # schedules.py, get_pp_rank_microbatches).
            chunks = num_mb * vpp
            exposed = pp_comm * min(1.0, (2 * (pp - 1) + (vpp - 1) * pp) / chunks)
            pp_comm = exposed + _overlapped(pp_comm - exposed, compute)

    # --- data-parallel gradient (and parameter) communication
    shard = dp * cp
    params = max(s.total for s in all_stage_params(m, layout.padded_vocab_size, tp, pp, layout.stage_layers))
    dp_bw = c.inter_node_bandwidth_gbs if _spans_nodes(cfg, shard, tp) else c.intra_node_bandwidth_gbs
    # Both backends reduce in fp32 with grad_reduce_in_fp32 (DeepSpeed's communication_data_type).
    grad_bytes = params * (4 if cfg.precision.dtype == "fp32" or cfg.precision.grad_reduce_in_fp32 else nbytes)
    # zero.overlap_comm=false: reduced after the last backward (as Megatron-LM's local DDP did
    # before overlap_grad_reduce: training.py train_step, allreduce_gradients after forward_backward).
    overlap = 1.0 if c.device == "cuda" and cfg.zero.overlap_comm else 0.0
    backward_window = (2 / 3) * per_microbatch * 0.9 * overlap  # the last bucket is never overlapped
    forward_window = (1 / 3) * per_microbatch * overlap
    zero = backend.effective_zero(cfg.zero.stage)
    if backend.grad_reduce is GradReduce.OVERLAPPED_BUCKETS:
        if zero == 1:
            reduce = ring(grad_bytes, shard, dp_bw, 1.0)
            gather = ring(params * nbytes, shard, dp_bw, 1.0)
            dp_comm = _overlapped(reduce, backward_window) + _overlapped(gather, forward_window)
        else:
            dp_comm = _overlapped(ring(grad_bytes, shard, dp_bw, 2.0), backward_window)
    elif zero <= 1:  # DeepSpeed reduces once per step after the last backward
        dp_comm = ring(grad_bytes, shard, dp_bw, 2.0 if zero == 0 else 1.0)
        if zero == 1:
            dp_comm += ring(params * nbytes, shard, dp_bw, 1.0)
    else:  # ZeRO-2/3 reduce-scatter every micro-batch, overlapped with backward (overlap_comm)
        reduce = ring(grad_bytes, shard, dp_bw, 1.0)
        if zero == 2:
            dp_comm = num_mb * _overlapped(reduce, backward_window) + ring(params * nbytes, shard, dp_bw, 1.0)
        else:  # gather parameters for forward and backward of every micro-batch, on the same link
            gathers = 2 * ring(params * nbytes, shard, dp_bw, 1.0)
            dp_comm = num_mb * _overlapped(reduce + gathers, ZERO3_OVERLAP * per_microbatch * overlap)

    # --- optimizer step: read and write master weights, grads, Adam moments
    shard_params = params / (shard if zero >= 1 else 1)
    if cfg.zero.offload_optimizer != "none":
        optimizer = shard_params / HOST_ADAM_PARAMS_PER_S
    else:
        optimizer = shard_params * (4 + 4 + 8 + nbytes) * 2 / hbm

    step = compute + pp_comm + dp_comm + optimizer + c.step_overhead_s + step_s * sharing
    flops = step_flops(m, seq, layout.global_batch, recompute, layout.padded_vocab_size)
    world = layout.world_size
    return StepEstimate(
        step_time=step,
        compute=compute,
        bubble=bubble,
        tp_comm=num_mb * tp_per_microbatch,
        pp_comm=pp_comm,
        dp_comm=dp_comm,
        optimizer=optimizer,
        tokens_per_s=flops.tokens / step,
        tflops_per_gpu=flops.model / step / world / 1e12,
        mfu=flops.model / step / world / mfu_peak_flops(cfg),
        hfu=flops.hardware / step / world / mfu_peak_flops(cfg),
        stage_times=tuple(stage_times),
    )
