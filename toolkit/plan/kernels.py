"""Seconds of one kernel on one device: GEMMs (tile and wave quantization on GPUs, the fitted
saturation curve on CPUs), linear layers forward and backward, unfused attention, and the rates
the device sustains (peak FLOP/s, a job's slowest chip)."""

from __future__ import annotations

import functools
import math
import statistics

from toolkit.config.schema import Config

# FlashAttention-2 forward+backward runs at 50-70% of peak where large GEMMs reach ~80%
# (Dao 2023, "FlashAttention-2", section 4.1).
ATTENTION_EFFICIENCY = 0.75
# glibc's largest dynamic mmap threshold on 64-bit (mallopt(3), DEFAULT_MMAP_THRESHOLD_MAX): a
# tensor at least this large gets fresh pages at every allocation.
FRESH_BYTES = 32 * 2**20
# FP8 tensor-core GEMMs held at the power limit reach a slightly smaller fraction of their (2x)
# peak than BF16 ones: cuBLASLt FP8 6144x12288x12288 after 10,000 warm-up iterations runs 1351.4
# (H100) and 1318.0 (H200) of 1979 TFLOP/s, 68.3% and 66.6% (Azure/AI-benchmarking-guide,
# Azure_Results/ND_H100_v5_results.md, ND_H200_v5_results.md), against BF16's sustained 70.6%:
# 0.97 and 0.94. Transformer Engine casts the activations inside the norm or activation kernel
# before each GEMM (LayerNormLinear, LayerNormMLP) and the weights once per step (their FP8 copies
# are kept across micro-batches, is_first_microbatch), so the casts add no pass of their own.
FP8_GEMM_FRACTION = 0.95


# Bytes the element-wise kernels of one eager transformers Llama layer (LlamaDecoderLayer: RMSNorm as
# upcast, pow, mean, rsqrt, mul, downcast and weight mul; RoPE as slices, neg, cat, mul and add;
# SwiGLU as silu and mul; the residual adds) read and write per token, forward and backward, the
# attention kernel and GEMMs left out: per unit of the hidden size (by the activations' bytes: in
# 16 bits the norms also pass fp32 upcasts), of the FFN size and of the q and k/v widths, and per token
# (the norms' per-token statistics, the rotary tables). Counted
# operation by operation (each op's input and output tensors) under a dispatch mode; asserted by
# tests/test_layer_dispatches.py.
EAGER_LAYER_BYTES = {2: (308, 28, 56, 638), 4: (336, 56, 112, 1156)}  # activation bytes -> (h, ffn, q + kv, 1)


def eager_layer_bytes(tokens: float, h_tokens: float, ffn_tokens: float, qkv_tokens: float, nbytes: int) -> float:
    """Bytes the eager element-wise kernels of one layer move, forward and backward, over `tokens`:
    `h_tokens` hidden-size values (tokens x h, split by sequence parallel), `ffn_tokens` FFN values
    (tokens x FFN size on this rank) and `qkv_tokens` q and k/v values (tokens x (q + kv) on this rank)."""
    per_h, per_ffn, per_qkv, per_token = EAGER_LAYER_BYTES[4 if nbytes >= 4 else 2]
    return per_h * h_tokens + per_ffn * ffn_tokens + per_qkv * qkv_tokens + per_token * tokens


def dispatched_time(device_s: float, host_s: float) -> float:
    """Seconds of work that keeps the device busy for device_s and the host for host_s issuing it
    (about 5-25 us of host work per eager PyTorch op: Python, the dispatcher, autograd and the
    launch; J. Lin, "From PyTorch op to kernel launch"): the host issues operations ahead of the
    device, so the slower of the two sets the pace."""
    return max(device_s, host_s)


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


@functools.lru_cache(maxsize=4096, typed=True)  # a pure function of numbers: the search asks again
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


@functools.lru_cache(maxsize=4096, typed=True)  # a pure function of numbers: the search asks again
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


def unfused_attention(scores: float, d: int, flops_per_s: float, hbm: float, nbytes: int, dropout: float):
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


def fresh_time(cfg: Config, nbytes: float) -> float:
    """Seconds a new tensor of nbytes costs beyond its writes where the allocator maps it afresh
    (CPU: glibc's malloc maps blocks over FRESH_BYTES with mmap, mallopt(3), and every page faults
    in on first write); 0 where allocations reuse memory (the GPU caching allocator)."""
    fresh = cfg.cluster.fresh_memory_gbs
    return nbytes / (fresh * 1e9) if fresh and nbytes >= FRESH_BYTES else 0.0
