"""Step time, throughput and MFU of a layout, from FLOPs, bandwidths and the schedule.

estimate_step sums named terms, each a function here, so that a new cost has a place:
`layer_cost` (one layer's compute and its tensor/context-parallel communication), `logits_cost`
(the last stage's output layer and loss), `stage_times` (a micro-batch per pipeline stage, on a CPU
node with its shared cores), the pipeline's schedule (bubble), `pipeline_comm`,
`data_parallel_comm` (by the backend's way of reducing) and `optimizer_time`. The kernels' times are
toolkit.plan.kernels', the collectives' toolkit.plan.collectives'.

Compute: each GEMM at the cluster's large-GEMM efficiency, reduced by its shapes: on GPUs by tile
and wave quantization of its output over the SMs, plus the store of its output through HBM
(`gemm_time`: forward and the two backward GEMMs each with their own shapes); on CPU by the
saturation curve `parakit probe` fits (`shape_efficiency`). Flash attention at
ATTENTION_EFFICIENCY of the GEMM rate; unfused GPU attention as batched GEMMs at their roofline
plus softmax and dropout passes; memory-bound element-wise work (norms, activations, residuals)
as bytes over HBM bandwidth.
Tensor parallel: per layer and micro-batch, 2 all-reduces forward and 2 backward (or the same
volume as all-gather + reduce-scatter with sequence parallel) of b*s*h values (Narayanan et al.
2021, section 3.3; Korthikanti et al. 2022, section 4.2.2), exposed unless parallel.tp_comm_overlap
hides them under the layer's GEMMs; on CPU (gloo) a collective is work of the node's cores, shared
with the compute as that is.
Pipeline: (m + (p-1)/v) micro-batch times per step (Narayanan et al. 2021, section 2.2.2) plus
point-to-point sends of b*s*h activations per chunk boundary.
Data parallel: ring reduce-scatter/all-gather, (d-1)/d of the bytes over the slowest link per
GPU (Patarasuk & Yuan 2009); overlapped with the last micro-batch's backward where the backend
overlaps (Megatron overlap_grad_reduce / DeepSpeed overlap_comm; zero.overlap_comm=false turns
it off). ZeRO-3 gathers parameters for every micro-batch's forward and backward (Rajbhandari et
al. 2020, section 7.2.2), prefetched.
Mixture of experts: an MoE layer's MLP is router_topk experts' GEMMs per token (on each rank
router_topk x the rank's tokens, over the expert FFN / etp, times the routing imbalance) and the
router's; its tokens go to their experts and back in an all-to-all each way, forward and backward
(megatron-core's MoEAlltoAllTokenDispatcher: dispatch and combine), each rank sending router_topk
copies of its tokens, (ep-1)/ep of them off the rank, over the links the expert group spans
(Lepikhin et al. 2021, "GShard", section 3.2; Liu et al. 2025, arXiv 2504.14960, section 3), and
with etp > 1 an all-gather and reduce-scatter of those tokens over the etp ranks. The experts'
gradients reduce over the expert-data-parallel ranks, the rest over dp x cp.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from toolkit.config.schema import Config, expert_ffn_size, head_dim, kv_heads
from toolkit.plan.backends import Backend, GradReduce, backend_of
from toolkit.plan.collectives import all_to_all_time, link_gbs, overlapped, p2p_time, ring_time, send_gbs
from toolkit.plan.flops import step_flops
from toolkit.plan.kernels import (
    ATTENTION_EFFICIENCY,
    FP8_GEMM_FRACTION,
    dispatched_time,
    eager_layer_bytes,
    fresh_time,
    linear_time,
    mfu_peak_flops,
    peak_flops,
    shape_efficiency,
    slowest_chip_factor,
    unfused_attention,
)
from toolkit.plan.layout import Layout
from toolkit.plan.memory import DTYPE_BYTES, routing_imbalance
from toolkit.plan.params import OUTER_PARAMETER_MODULES, all_stage_params, layer_parameter_modules

# ZeRO-3 prefetches parameters one or two layers ahead: gathers hide under at most half of the
# compute (assumption), and share the link with the gradient reduce-scatters.
ZERO3_OVERLAP = 0.5
# A host (offloaded) Adam updates about 1e9 parameters per second per GPU (DeepSpeed CPU-Adam,
# Ren et al. 2021, "ZeRO-Offload", Table 4 order of magnitude).
HOST_ADAM_PARAMS_PER_S = 1e9
# ZeRO++'s quantized collectives (Wang et al. 2023, arXiv 2306.10209), bytes per parameter on the
# wire: qwZ all-gathers int8 weights (section 4.1; DeepSpeed runtime/zero/partition_parameters.py
# CUDAQuantizer, one scale per group of up to 16k values), qgZ reduces int4 gradients (section 4.3;
# runtime/comm/coalesced_collectives.py all_to_all_quant_reduce). The scales are left out.
QUANTIZED_WEIGHT_BYTES = 1.0
QUANTIZED_GRAD_BYTES = 0.5


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
    ep_comm: float = 0.0  # the MoE layers' all-to-all (and etp) token traffic of the slowest stage

    @property
    def comm_share(self) -> float:
        return (self.tp_comm + self.pp_comm + self.dp_comm + self.ep_comm) / self.step_time

    @property
    def all_to_all_share(self) -> float:
        return self.ep_comm / self.step_time


def _elementwise_bytes(m, tokens: int, tp: int, sp: bool, nbytes: int, mlp_elements: float | None = None) -> float:
    """Bytes element-wise ops move per layer and micro-batch, forward and backward (x3).
    `mlp_elements`: the MLP activation's input and output elements on this rank (default: the dense
    MLP's over the micro-batch's tokens; an MoE layer's are `_moe_mlp_elements`)."""
    h, d = m.hidden_size, head_dim(m)
    q, kv = m.num_attention_heads * d, kv_heads(m) * d
    if mlp_elements is None:
        mlp_elements = tokens * _activation_io(m) * m.ffn_hidden_size / tp
    replicated = 10 * h / (tp if sp else 1)  # 2 norms (read + write), 2 residual adds (2 reads + write)
    rope = 2 * (q + kv) / tp  # RoPE on q, k
    return 3 * (tokens * (replicated + rope) + mlp_elements) * nbytes


def _eager_bytes(m, tokens: int, tp: int, sp: bool, nbytes: int, mlp_elements: float | None = None) -> float:
    """Bytes the eager element-wise passes of a transformers layer move per micro-batch, forward and
    backward (toolkit.plan.kernels.eager_layer_bytes); an MoE layer's MLP by its activation's
    elements (`mlp_elements`, in FFN units as a dense MLP's)."""
    h, d = m.hidden_size, head_dim(m)
    qkv = (m.num_attention_heads + kv_heads(m)) * d
    ffn = tokens * m.ffn_hidden_size / tp if mlp_elements is None else mlp_elements / _activation_io(m)
    return eager_layer_bytes(tokens, tokens * h / (tp if sp else 1), ffn, tokens * qkv / tp, nbytes)


def _activation_io(m) -> int:
    """The MLP activation's input and output elements per FFN unit: gated (SwiGLU) reads 2 and
    writes 1, else 1 and 1."""
    return 3 if m.activation == "swiglu" else 2


def _routed_tokens(cfg: Config, layout: Layout) -> float:
    """Rows an MoE layer's experts compute on the busiest rank per micro-batch: router_topk copies of
    the tokens its expert group sends it (gathered over etp), times the routing imbalance."""
    m, d = cfg.model, layout.dims
    return m.moe.router_topk * layout.gpu_tokens * d.etp / d.tp * routing_imbalance(m)


def _moe_mlp_elements(cfg: Config, layout: Layout) -> float:
    """An MoE layer's activation input and output elements on one rank: its experts' over the tokens
    routed to it, and the shared experts' over all its tokens."""
    m, d = cfg.model, layout.dims
    elements = _routed_tokens(cfg, layout) * _activation_io(m) * expert_ffn_size(m) / d.etp
    if m.moe.shared_expert_size:
        elements += layout.gpu_tokens * _activation_io(m) * m.moe.shared_expert_size / d.tp
    return elements


def _permutation_bytes(cfg: Config, layout: Layout, nbytes: int) -> float:
    """Bytes an MoE layer's token permutations move per micro-batch, forward and backward (megatron-core
    transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher; moe_utils.permute, unpermute,
    sort_chunks_by_idxs): each rank copies router_topk rows of its tokens into expert order before the
    all-to-all (a read and a write) and adds them back, weighted, after it (a read and a write); with
    several local experts the received rows are sorted by expert and back again. The backward
    permutes the gradients the same way."""
    m, d = cfg.model, layout.dims
    sent = m.moe.router_topk * layout.gpu_tokens / d.tp  # rows leaving this rank (sequence parallel)
    rows = 4 * sent  # permute and unpermute: each a read and a write
    if m.moe.num_experts // d.ep > 1:
        rows += 4 * _routed_tokens(cfg, layout)  # the received rows, sorted and unsorted
    return 2 * rows * m.hidden_size * nbytes


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


@dataclass(frozen=True)
class Rates:
    """What one GPU of the job sustains for this configuration."""

    gemm: float  # FLOP/s of the layers' GEMMs (fp8 where the run is)
    attention: float  # FLOP/s of attention's matrix products (bf16 under fp8)
    hbm: float  # bytes/s a kernel streams
    nbytes: int  # bytes per activation value


def rates(cfg: Config, world_size: int) -> Rates:
    c, dtype = cfg.cluster, cfg.precision.dtype
    efficiency = c.gemm_efficiency * slowest_chip_factor(world_size, c.gemm_chip_spread)
    gemm = peak_flops(cfg) * efficiency * (FP8_GEMM_FRACTION if dtype == "fp8" else 1.0)
    attention = (peak_flops(cfg) if dtype != "fp8" else c.peak_tflops_bf16 * 1e12) * efficiency
    return Rates(gemm, attention, c.hbm_bandwidth_gbs * 1e9, DTYPE_BYTES[dtype])


def _wgrad_bytes(backend: Backend, nbytes: int) -> int:
    """Bytes a wgrad GEMM's epilogue moves per weight: its 16-bit gradient written. (Megatron-LM's
    gradient_accumulation_fusion would add into the fp32 main_grad in the epilogue instead, 8 bytes;
    parakit's megatron runs leave it off, toolkit.emit.megatron, and add separately:
    `grad_accumulation_time`.)"""
    return nbytes


def grad_accumulation_time(cfg: Config, backend: Backend, params: float, r: Rates) -> float:
    """Seconds per micro-batch of adding the rank's `params` gradients into the gradients kept
    across micro-batches, on a GPU (on CPU the probe's stack costs hold it): in 16-bit training with
    fp32 gradients the backend's own pass (Backend.grad_accumulation_bytes), else an add of two
    gradients into one (two reads, a write)."""
    if cfg.cluster.device != "cuda":
        return 0.0
    zero = backend.effective_zero(cfg.zero.stage)
    fp32_grads = backend.fp32_grads_from_stage is not None and zero >= backend.fp32_grads_from_stage
    if r.nbytes < 4 and fp32_grads and cfg.precision.grad_reduce_in_fp32:
        return params * backend.grad_accumulation_bytes / r.hbm
    return params * 3 * r.nbytes / r.hbm


@dataclass(frozen=True)
class LayerCost:
    """One transformer layer, one micro-batch, forward and backward (and any recompute) on one GPU."""

    compute: float  # the work of the device (on a CPU node: of its shared cores)
    comm: float  # tensor-, context- and expert-parallel communication it waits on
    tp_comm: float  # of which tensor parallel
    ep_comm: float = 0.0  # of which the experts' token all-to-all (MoE layers)


def _attention_time(cfg: Config, layout: Layout, r: Rates, tokens: int) -> tuple[float, float]:
    """Forward and backward seconds of the attention's core (scores, softmax, weighted values)."""
    m, c = cfg.model, cfg.cluster
    tp, cp, seq, d = layout.tp, layout.cp, layout.seq_length, head_dim(m)
    q = m.num_attention_heads * d
    if cfg.train.attention_backend == "flash":  # skips the masked half of the causal scores
        block = seq / (2 * cp) if cp > 1 else tokens  # context parallel attends in 2*cp chunks
        attention_peak = r.attention * ATTENTION_EFFICIENCY * shape_efficiency(c.gemm_half_size, block, d)
        fwd = 2 * 2 * tokens * seq * (q / tp) * 0.5 / attention_peak
    elif c.sm_count:
        heads = m.num_attention_heads / tp
        return unfused_attention(heads * tokens * seq, d, r.attention, r.hbm, r.nbytes, m.attention_dropout)
    else:  # batched GEMMs per head over all s^2 scores, softmax through HBM (2 passes fwd, 3 bwd / 3)
        fwd = 2 * 2 * tokens * seq * (q / tp) / (r.attention * shape_efficiency(c.gemm_half_size, seq, seq, d))
        fwd += 5 / 3 * (m.num_attention_heads / tp) * tokens * seq * r.nbytes / r.hbm
    return fwd, 2 * fwd


def _context_parallel_comm(cfg: Config, layout: Layout, r: Rates, tokens: int, attention_s: float) -> float:
    """K/V exchange of one layer and micro-batch: every rank receives the other ranks' K and V (one
    pass: an all-gather's volume)."""
    m, c, p = cfg.model, cfg.cluster, cfg.parallel
    tp, cp = layout.tp, layout.cp
    if cp <= 1:
        return 0.0
    kv = kv_heads(m) * head_dim(m)
    kv_pass = ring_time(
        cp * tokens * 2 * kv / tp * r.nbytes,
        cp,
        link_gbs(cfg, cp, layout.dims.stride("cp")),
        1.0,
        c.collective_latency_s,
    )
    if c.device == "cpu":  # toolkit.train's SdpaAttention: K/V all-gathered once (autograd keeps
        # them), their gradients reduce-scattered
        return 2 * kv_pass
    if p.cp_comm_type == "all_gather":  # Transformer Engine gathers K/V again for the backward
        # and reduce-scatters dK/dV, all exposed (AttnFuncWithCPAndKVAllGather; Llama 3, section 3.3.2)
        return 3 * kv_pass
    # the ring: K/V forward, K/V and dK/dV backward, each step's sends hidden under the attention of
    # the step before (Megatron context parallel, Liu et al. 2023 "Ring Attention")
    return overlapped(3 * kv_pass, attention_s)


def _moe_gemms(cfg: Config, layout: Layout) -> list[tuple[float, float, float]]:
    """(M, N, K) of an MoE layer's MLP GEMMs on one rank: the router's, the rank's experts' over
    router_topk x its tokens (times the imbalance) and the shared experts' (split by tp)."""
    m, d = cfg.model, layout.dims
    h, tokens, gated = m.hidden_size, layout.gpu_tokens, 2 if m.activation == "swiglu" else 1
    routed = _routed_tokens(cfg, layout)
    ffn = expert_ffn_size(m) / d.etp
    gemms = [(tokens, m.moe.num_experts, h), (routed, gated * ffn, h), (routed, h, ffn)]
    if m.moe.shared_expert_size:
        shared = m.moe.shared_expert_size / d.tp
        gemms += [(tokens, gated * shared, h), (tokens, h, shared)]
    return gemms


def _expert_comm(cfg: Config, layout: Layout, r: Rates) -> float:
    """One MoE layer's token traffic for a micro-batch: the all-to-all over the ep ranks each way,
    forward and backward (again under full recompute), and with etp > 1 the all-gather and
    reduce-scatter of the received tokens over the etp ranks."""
    m, d, c = cfg.model, layout.dims, cfg.cluster
    passes = 4 + (2 if cfg.recompute.granularity == "full" else 0)
    sent = m.moe.router_topk * layout.gpu_tokens / d.tp * m.hidden_size * r.nbytes * routing_imbalance(m)
    alltoall = all_to_all_time(cfg, sent, d.ep, d.stride("ep"))
    gather = ring_time(sent * d.etp, d.etp, link_gbs(cfg, d.etp, 1), 1.0, c.collective_latency_s)
    return passes * (alltoall + gather)


def layer_cost(cfg: Config, layout: Layout, backend: Backend, r: Rates, stack, moe: bool = False) -> LayerCost:
    """A layer's (`moe`: an MoE layer's) compute, which shares a CPU node's cores, and its
    communication, which waits."""
    m, c, p = cfg.model, cfg.cluster, cfg.parallel
    tp, h, d = layout.tp, cfg.model.hidden_size, head_dim(cfg.model)
    tokens = layout.gpu_tokens
    q, kv = m.num_attention_heads * d, kv_heads(m) * d
    ffn_in = m.ffn_hidden_size * (2 if m.activation == "swiglu" else 1)
    recompute = cfg.recompute.granularity

    gemms = [(tokens, (q + 2 * kv) / tp, h), (tokens, h, q / tp)]  # (M, N, K)
    if moe:
        gemms += _moe_gemms(cfg, layout)
    else:
        gemms += [(tokens, ffn_in / tp, h), (tokens, h, m.ffn_hidden_size / tp)]
    times = [linear_time(c, t, n, k, r.gemm, r.nbytes, _wgrad_bytes(backend, r.nbytes)) for t, n, k in gemms]
    gemm_fwd = sum(f for f, _ in times)
    gemm_bwd = sum(b for _, b in times)
    core_fwd, core_bwd = _attention_time(cfg, layout, r, tokens)
    mlp_elements = _moe_mlp_elements(cfg, layout) if moe else None
    passes = _eager_bytes if backend.eager_layers else _elementwise_bytes
    elementwise = passes(m, tokens, tp, p.sequence_parallel, r.nbytes, mlp_elements) / r.hbm
    # megatron-core's dispatcher permutes the tokens (transformers' MoE blocks index them per expert
    # instead, priced with the element-wise traffic)
    permutation = _permutation_bytes(cfg, layout, r.nbytes) / r.hbm if moe and not backend.moe.family_modules else 0.0
    compute = gemm_fwd + gemm_bwd + core_fwd + core_bwd + elementwise + permutation
    if recompute == "full":
        compute += gemm_fwd + core_fwd + elementwise / 3 + permutation / 2
    elif recompute == "selective":
        compute += core_fwd
    stack_layer = stack.layer_s if stack else 0.0  # the measured stack's cost beyond the modelled work
    if c.device == "cuda":  # a GPU waits for the host where the layer's kernels are short
        # The GPU probe fits stack.layer_s where a tiny layer is host-bound (machine_fit.fit_stack):
        # the framework's host work beside the dispatched ops, which hides under long kernels too.
        issued = backend.layer_dispatches * c.op_dispatch_s + stack_layer
        host = issued * (4 / 3 if recompute == "full" else 1)
        compute = dispatched_time(compute, host + zero3_bookkeeping(cfg, backend, layer_parameter_modules(m, moe)))
        stack_layer = 0.0
    compute += c.layer_overhead_s + stack_layer + (stack.tp_layer_s if stack and tp > 1 else 0.0)

    collectives = 4 + (2 if recompute == "full" else 0)
    tp_collective = ring_time(
        tokens * h * r.nbytes, tp, link_gbs(cfg, tp, layout.dims.stride("tp"), 2.0), 2.0, c.collective_latency_s
    )
    tp_comm = collectives * tp_collective
    if p.tp_comm_overlap:  # Transformer Engine's userbuffers split each GEMM and exchange the chunks
        # of its all-gather / reduce-scatter while the other chunks compute (megatron-core
        # tp_comm_overlap; Wang et al. 2023, "Overlap Communication with Dependent Computation via
        # Decomposition in Large Deep Learning Models", section 3): hidden up to the layer's GEMMs
        tp_comm = overlapped(tp_comm, gemm_fwd * (2 if recompute == "full" else 1) + gemm_bwd)
    ep_comm = _expert_comm(cfg, layout, r) if moe else 0.0
    comm = tp_comm + _context_parallel_comm(cfg, layout, r, tokens, core_fwd + core_bwd) + ep_comm
    return LayerCost(compute, comm, tp_comm, ep_comm)


def logits_cost(cfg: Config, layout: Layout, backend: Backend, r: Rates, stack) -> tuple[float, float]:
    """The last stage's output layer and loss for one micro-batch: compute and communication."""
    c, h, tp = cfg.cluster, cfg.model.hidden_size, layout.tp
    tokens = layout.gpu_tokens
    vocab_shard = layout.padded_vocab_size / tp
    logit_bytes = tokens * vocab_shard * 4  # the loss is computed in fp32
    if backend.loss_upcasts:  # fp32 passes; 16-bit logits add the upcast (read 16 bits, write 32) and
        # the gradient's downcast
        passes = backend.loss_logit_passes * 4 + (2 * (r.nbytes + 4) if r.nbytes < 4 else 0)
    else:  # passes at the logits' own dtype
        passes = backend.loss_logit_passes * r.nbytes
    compute = (
        sum(linear_time(c, tokens, vocab_shard, h, r.gemm, r.nbytes, _wgrad_bytes(backend, r.nbytes)))
        + (stack.loss_s_per_logit * logit_bytes / 4 if stack else passes * logit_bytes / 4 / r.hbm)
        + backend.loss_fresh_logits * fresh_time(cfg, logit_bytes)
    )
    if c.device == "cuda":  # ZeRO-3's handling of the embedding, final norm and output layer
        compute = dispatched_time(compute, zero3_bookkeeping(cfg, backend, OUTER_PARAMETER_MODULES))
    # the vocab-parallel loss's max, target logit and sum
    comm = 3 * ring_time(tokens * 4, tp, link_gbs(cfg, tp, layout.dims.stride("tp"), 2.0), 2.0, c.collective_latency_s)
    return compute, comm


def stage_times(
    cfg: Config,
    layout: Layout,
    layer: LayerCost,
    logits: tuple[float, float],
    step_s: float,
    moe: tuple[LayerCost, tuple[int, ...]] | None = None,
    per_stage: list[float] | None = None,
):
    """One micro-batch's forward and backward on each pipeline stage (the last adds the logits), and
    how much slower the shared CPU cores run it (1 on GPUs). `moe`: an MoE layer's cost and how
    many of each stage's layers are MoE layers; `per_stage`: further work of each stage per
    micro-batch (its gradients' accumulation)."""
    work = [n * layer.compute for n in layout.stage_layers]
    if per_stage:
        work = [t + extra for t, extra in zip(work, per_stage)]
    comm = [n * layer.comm for n in layout.stage_layers]
    if moe:
        moe_layer, counts = moe
        work = [t + n * (moe_layer.compute - layer.compute) for t, n in zip(work, counts)]
        comm = [t + n * (moe_layer.comm - layer.comm) for t, n in zip(comm, counts)]
    work[-1] += logits[0]
    comm[-1] += logits[1]
    if cfg.cluster.device == "cpu":  # gloo's collectives are the cores' own work: copies through
        # loopback sockets by the ranks' threads (gloo/transport/tcp), not a network card's
        work, comm = [t + m for t, m in zip(work, comm)], [0.0] * layout.pp
    sharing = _core_sharing(cfg, layout, work, step_s)
    return [t * sharing + m for t, m in zip(work, comm)], sharing


def pipeline_comm(cfg: Config, layout: Layout, r: Rates, compute: float) -> float:
    """Point-to-point sends of a step: activations forward, gradients backward, per chunk boundary;
    under sequence parallel each GPU sends its seq/tp share (megatron-core
    pipeline_parallel/schedules.py, get_tensor_shapes)."""
    tp, pp, vpp = layout.tp, layout.pp, layout.vpp
    if pp <= 1:
        return 0.0
    tokens = layout.gpu_tokens
    num_mb = layout.num_microbatches
    sent = tokens // (tp if cfg.parallel.sequence_parallel else 1) * cfg.model.hidden_size * r.nbytes
    sends = num_mb * vpp * 2 * p2p_time(cfg, sent, send_gbs(cfg, pp, layout.dims.stride("pp")))
    if vpp > 1 and cfg.cluster.device == "cuda":  # megatron-core overlap_p2p_comm (toolkit.emit.megatron)
        # Sends of the steady state wait under the next chunk's compute; those of the warm-up
        # and the flush wait alone (overlap_p2p_comm_warmup_flush off). The first stage warms
        # up the most chunks: 2 (pp - 1) + (vpp - 1) pp (megatron-core pipeline_parallel/
        # schedules.py, get_pp_rank_microbatches).
        exposed = sends * min(1.0, (2 * (pp - 1) + (vpp - 1) * pp) / (num_mb * vpp))
        return exposed + overlapped(sends - exposed, compute)
    return sends


def data_parallel_comm(
    cfg: Config,
    layout: Layout,
    backend: Backend,
    params: int,
    per_microbatch: float,
    group: tuple[int, int] | None = None,
) -> float:
    """Exposed gradient (and parameter) traffic of a step among the dp x cp replicas (`group`: the
    size and stride of other replicas, the experts' expert-dp ranks), by the way the backend
    reduces: bucketed and overlapped (Megatron DDP), once after the backward (DeepSpeed ZeRO 0/1),
    or every micro-batch (ZeRO-2/3); and by the comm.* arrangement: hierarchical (optimizer
    instances, hpZ) or quantized (qwZ, qgZ)."""
    c, comm, nbytes = cfg.cluster, cfg.comm, DTYPE_BYTES[cfg.precision.dtype]
    shard, stride = group or (layout.dp * layout.cp, layout.dims.stride("cp"))  # the cp x dp ranks
    num_mb = layout.num_microbatches

    def ring(nbytes_: float, factor: float, size: int = shard, step: int = stride) -> float:
        return ring_time(nbytes_, size, link_gbs(cfg, size, step, factor), factor, c.collective_latency_s)

    # Both backends reduce in fp32 with grad_reduce_in_fp32 (DeepSpeed's communication_data_type).
    grad_bytes = params * (4 if cfg.precision.dtype == "fp32" or cfg.precision.grad_reduce_in_fp32 else nbytes)
    param_bytes = params * nbytes
    # zero.overlap_comm=false: reduced after the last backward (as Megatron-LM's local DDP did
    # before overlap_grad_reduce: training.py train_step, allreduce_gradients after forward_backward).
    overlap = 1.0 if c.device == "cuda" and cfg.zero.overlap_comm else 0.0
    backward_window = (2 / 3) * per_microbatch * 0.9 * overlap  # the last bucket is never overlapped
    forward_window = (1 / 3) * per_microbatch * overlap
    zero = backend.effective_zero(cfg.zero.stage)
    if backend.grad_reduce is GradReduce.OVERLAPPED_BUCKETS:
        if zero == 1:  # the distributed optimizer: reduce-scatter, then all-gather the updated params
            reduce = _instances_reduce(ring, grad_bytes, shard, stride, comm.optimizer_instances)
            gather = ring(param_bytes, 1.0, shard // comm.optimizer_instances)
            return overlapped(reduce, backward_window) + overlapped(gather, forward_window)
        return overlapped(ring(grad_bytes, 2.0), backward_window)
    if zero <= 1:  # DeepSpeed reduces once per step after the last backward
        return ring(grad_bytes, 2.0 if zero == 0 else 1.0) + (ring(param_bytes, 1.0) if zero == 1 else 0.0)
    # ZeRO-2/3 reduce-scatter every micro-batch, overlapped with backward (overlap_comm); ZeRO++'s
    # qgZ in int4 by two all-to-alls, inside each node and then across nodes of the node's shares
    # (all_to_all_quant_reduce), so the network carries 1/gpus_per_node of them
    reduce = ring(grad_bytes, 1.0)
    if comm.quantized_gradients:
        local = min(shard, c.gpus_per_node)
        quantized = params * QUANTIZED_GRAD_BYTES
        reduce = ring(quantized, 1.0, local, 1) + ring(quantized / local, 1.0, shard // local, local)
    if zero == 2:
        return num_mb * overlapped(reduce, backward_window) + ring(param_bytes, 1.0)
    # ZeRO-3 gathers parameters for forward and backward of every micro-batch, on the same link:
    # qwZ in int8 (section 4.1: half of fp16's bytes), the backward's from hpZ's secondary partition
    # inside its group of ranks where set (section 4.2)
    gather_bytes = params * QUANTIZED_WEIGHT_BYTES if comm.quantized_weights else param_bytes
    secondary = (comm.hpz_partition_size, 1) if comm.hpz_partition_size > 1 else (shard, stride)
    gathers = ring(gather_bytes, 1.0) + ring(gather_bytes, 1.0, *secondary)
    return num_mb * overlapped(reduce + gathers, ZERO3_OVERLAP * per_microbatch * overlap)


def _instances_reduce(ring, grad_bytes: float, shard: int, stride: int, instances: int) -> float:
    """The distributed optimizer's gradient reduction over `shard` ranks held as `instances` groups:
    reduce-scatter inside a group, then the group's shards all-reduced across the instances
    (megatron-core param_and_grad_buffer.py start_grad_sync, num_distributed_optimizer_instances);
    one group: the plain reduce-scatter."""
    inside = shard // instances
    reduce = ring(grad_bytes, 1.0, inside, stride)
    if instances > 1:
        reduce += ring(grad_bytes / inside, 2.0, instances, inside * stride)
    return reduce


# torch's AdamW step over fp32 values, bytes per parameter (torch/optim/adam.py): fused (_fused_adam,
# and apex's and Transformer Engine's FusedAdam) reads each parameter, its gradient and both moments
# and writes the parameter and the moments, 7 passes; the multi-tensor form (_multi_tensor_adam) runs
# one kernel per step: weight decay (mul_: 2 passes), lerp_ of the first moment (3), mul_ and
# addcmul_ of the second (2 + 3), sqrt, div_ and add_ of eps into a new denominator (2 + 2 + 2) and
# addcdiv_ into the parameter (4): 20 passes.
ADAMW_BYTES = {"fused": 7 * 4, "foreach": 20 * 4}


def zero3_bookkeeping(cfg: Config, backend: Backend, modules: int) -> float:
    """Host seconds per micro-batch of ZeRO-3's parameter handling for `modules` modules (DeepSpeed
    runtime/zero/parameter_offload.py and partitioned_param_coordinator.py: each module with
    parameters is fetched before and released after its forward and again its backward, and again
    the forward's under full recompute), cluster.zero3_module_s each; 0 below ZeRO-3. Host work:
    it hides under device work that takes longer."""
    shards = backend.shards_params_from_stage
    if shards is None or backend.effective_zero(cfg.zero.stage) < shards:
        return 0.0
    events = 4 + (2 if cfg.recompute.granularity == "full" else 0)
    return modules * events * cfg.cluster.zero3_module_s


def optimizer_time(
    cfg: Config,
    shard_params: float,
    r: Rates,
    grad_params: float | None = None,
    backend: Backend | None = None,
    layers: int = 0,
) -> float:
    """The optimizer step, memory-bound over every parameter the rank updates (`shard_params`): the
    gradients' norm (a read, for clipping), AdamW over the fp32 master, moments and gradient, and in
    16-bit training the updated master's downcast into the model's weights (megatron-core
    copy_main_params_to_model_params, DeepSpeed's bit16 partition copy); then the zeroing of the
    gradient buffers the rank keeps (`grad_params`, fp32 where accumulated in fp32) for the next
    step (megatron-core zero_grad_buffer, DeepSpeed zero_grad)."""
    if cfg.zero.offload_optimizer != "none":
        return shard_params / HOST_ADAM_PARAMS_PER_S
    downcast = 4 + r.nbytes if r.nbytes < 4 else 0
    grad_bytes = 4 if r.nbytes >= 4 or cfg.precision.grad_reduce_in_fp32 else r.nbytes
    zeroed = (shard_params if grad_params is None else grad_params) * grad_bytes
    c = cfg.cluster
    adam = "fused" if backend is None else backend.adam if c.transformer_engine else backend.plain_torch_adam
    device = (shard_params * (4 + ADAMW_BYTES[adam] + downcast) + zeroed) / r.hbm
    if backend is None or c.device != "cuda":
        return device
    # the step's per-tensor loops are issued by the host (a GPU waits where they outrun its work)
    dispatches = backend.step_dispatches_per_layer * layers + backend.step_dispatches
    return dispatched_time(device, dispatches * c.op_dispatch_s)


def estimate_step(cfg: Config, layout: Layout, backend: Backend | None = None) -> StepEstimate:
    """Predicted time of one optimizer step of `layout` (compute, tensor/pipeline/data-parallel
    communication, the pipeline bubble, the optimizer), and the throughput and MFU that follow.
    `backend`: the description to price it with (default: the configuration's backend)."""
    m, c = cfg.model, cfg.cluster
    backend = backend or backend_of(cfg)
    r = rates(cfg, layout.world_size)
    stack = c.stack.get(backend.name)  # measured costs of the software stack (`parakit probe`)
    step_s = stack.step_s if stack else 0.0

    d = layout.dims
    stage_params = all_stage_params(m, layout.padded_vocab_size, d.tp, d.pp, layout.stage_layers, d.vpp, d.ep, d.etp)
    layer = layer_cost(cfg, layout, backend, r, stack)
    moe_counts = tuple(s.moe_layers for s in stage_params)
    moe = (layer_cost(cfg, layout, backend, r, stack, moe=True), moe_counts) if any(moe_counts) else None
    zero = backend.effective_zero(cfg.zero.stage)
    grad_shard = d.dp * d.cp if backend.shards_grads_from_stage is not None and zero >= 2 else 1
    accumulation = [grad_accumulation_time(cfg, backend, s.total / grad_shard, r) for s in stage_params]
    logits = logits_cost(cfg, layout, backend, r, stack)
    stages, sharing = stage_times(cfg, layout, layer, logits, step_s, moe, accumulation)
    slowest = max(range(layout.pp), key=stages.__getitem__)
    per_microbatch = stages[slowest]
    bubble = (layout.pp - 1) / layout.vpp * per_microbatch
    compute = layout.num_microbatches * per_microbatch + bubble

    busiest = max(stage_params, key=lambda s: s.total)
    pp_comm = pipeline_comm(cfg, layout, r, compute)
    # the experts reduce over their expert-dp ranks (and shard their optimizer states there), the rest over dp x cp
    dp_comm = data_parallel_comm(cfg, layout, backend, busiest.dense, per_microbatch)
    if busiest.experts:
        dp_comm += data_parallel_comm(cfg, layout, backend, busiest.experts, per_microbatch, (d.edp, d.stride("edp")))
    experts_shard = busiest.experts / d.edp if busiest.experts else 0.0
    shard = busiest.dense / (d.dp * d.cp) + experts_shard if zero >= 1 else busiest.total
    optimizer = optimizer_time(cfg, shard, r, busiest.total / grad_shard, backend, busiest.layers)

    step = compute + pp_comm + dp_comm + optimizer + c.step_overhead_s + step_s * sharing
    flops = step_flops(m, layout.seq_length, layout.global_batch, cfg.recompute.granularity, layout.padded_vocab_size)
    world = layout.world_size
    return StepEstimate(
        step_time=step,
        compute=compute,
        bubble=bubble,
        tp_comm=layout.num_microbatches * layout.stage_layers[slowest] * layer.tp_comm,
        pp_comm=pp_comm,
        dp_comm=dp_comm,
        optimizer=optimizer,
        tokens_per_s=flops.tokens / step,
        tflops_per_gpu=flops.model / step / world / 1e12,
        mfu=flops.model / step / world / mfu_peak_flops(cfg),
        hfu=flops.hardware / step / world / mfu_peak_flops(cfg),
        stage_times=tuple(stages),
        ep_comm=layout.num_microbatches * moe_counts[slowest] * moe[0].ep_comm if moe else 0.0,
    )
