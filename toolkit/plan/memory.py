"""Memory per GPU: model states, activations, logits, buffers and allocator allowance.

Model states per parameter on a rank holding P parameters, data-parallel (sharding) degree d:
- megatron-core DDP (+ distributed optimizer = zero 1), Megatron-LM docs
  `docs/source/api-guide/dist_optimizer.md`: bf16/fp16 params 2, fp32 grads 4 (2 without
  grad_reduce_in_fp32), fp32 main params + Adam m, v 12 (/d with the distributed optimizer:
  6 + 12/d bytes). fp32 training keeps no separate main copy: 4 + 4 + 8 (/d).
- DeepSpeed ZeRO (Rajbhandari et al. 2020, "ZeRO", section 5 and Figure 1), as DeepSpeed 0.19
  implements it (measured in tests/test_memory_engines.py): stage 0 all local; stages 1 and 2
  partition the fp32 master copy, the Adam states and the gradients (DeepSpeed reduces stage-1
  gradients into partitions like stage 2, unlike the paper's 4 + 12/d); stage 3 also the
  parameters. Stages 1-3 keep an fp32 master partition even when training in fp32. In 16-bit
  with grad_reduce_in_fp32 (emitted as fp32 communication and accumulation), stage 1 holds a full
  fp32 gradient buffer beside the 16-bit gradients (BF16_Optimizer: 4 + 2 per parameter, measured
  on one rank), stages 2 and 3 an fp32 gradient partition (4/d, measured).
Activations per layer follow Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4 (34 s b h + 5 a s^2 b bytes in fp16 with dropout),
generalised to GQA, SwiGLU, dropout on/off, any dtype and flash attention (which stores no
s^2 scores). The first pipeline stage holds the most in-flight micro-batches: p for 1F1B, and
p*v + p - 1 model chunks for interleaved 1F1B (Korthikanti et al. 2022, section 4.2.3).
Mixture-of-experts layers: the expert weights' states shard over the expert-data-parallel ranks
(megatron-core's distributed optimizer keeps them in their own buffers, reduced and sharded over
the expert-dp group), the rest over dp x cp as a dense model's. Each token's activations pass
router_topk experts of the expert FFN size, spread over the expert mesh: per rank the dense MLP's
term with router_topk x the expert FFN, plus the permuted expert inputs and the router's fp32
scores, times an allowance for uneven routing (the capacity factor, when tokens are dropped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

from toolkit.config.schema import Config, ModelConfig, expert_ffn_size, head_dim, kv_heads
from toolkit.plan.backends import Backend, GradReduce, backend_named, backend_of
from toolkit.plan.layout import Layout
from toolkit.plan.params import layer_params, layout_stage_params

GIB = 1024**3
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # fp8 keeps bf16 weights/activations
# PyTorch's caching allocator rounds and fragments: allow 10% on top of activations and buffers
# (typical reserved/allocated ratio in Megatron-LM memory reports), plus the CUDA context,
# cuBLAS workspace and NCCL buffers on a GPU.
FRAGMENTATION = 0.10
CUDA_RUNTIME_BYTES = 1.0 * GIB
# Dropless routing bounds no expert's load: allow the busiest rank 25% over the even share, the
# capacity factor that Switch Transformer trains with (Fedus et al. 2021, section 2.2 and Table 1).
MOE_IMBALANCE = 1.25


def routing_imbalance(m: ModelConfig) -> float:
    """How far over the even share of routed tokens the busiest expert rank gets: the capacity
    factor, which bounds it, or MOE_IMBALANCE for dropless routing."""
    return m.moe.capacity_factor or MOE_IMBALANCE


@dataclass(frozen=True)
class ModelStates:
    weights: float
    grads: float
    optimizer: float  # Adam m, v and fp32 master copy

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer

    def __add__(self, other: ModelStates) -> ModelStates:
        return ModelStates(self.weights + other.weights, self.grads + other.grads, self.optimizer + other.optimizer)


def model_state_bytes(
    params: int,
    dtype: str,
    backend: str | Backend,
    zero: int,
    shard: int,
    grad_reduce_in_fp32: bool = True,
    offload_optimizer: bool = False,
    offload_param: bool = False,
) -> ModelStates:
    """Device bytes of parameters, gradients and optimizer states for `params` parameters on a
    rank whose optimizer states are sharded `shard` ways (ZeRO, Rajbhandari et al. 2020, section 5;
    Megatron's distributed optimizer shards the optimizer states only)."""
    be = backend if isinstance(backend, Backend) else backend_named(backend)
    p = float(params)

    def from_stage(stage: int | None) -> bool:
        return stage is not None and zero >= stage

    def sharded_from(stage: int | None) -> int:
        return shard if from_stage(stage) else 1

    fp32_grads = dtype != "fp32" and grad_reduce_in_fp32 and from_stage(be.fp32_grads_from_stage)
    if dtype == "fp32":
        weight, grad, master = 4, 4, 0
    else:
        weight, master = 2, 4
        grad = 4 if fp32_grads else 2
    adam = 8
    # DeepSpeed: stages >= 1 keep an fp32 master partition even for fp32 params.
    master = 4 if from_stage(be.fp32_master_from_stage) else master
    weights = weight * p / sharded_from(be.shards_params_from_stage)
    grads = grad * p / sharded_from(be.shards_grads_from_stage)
    if fp32_grads and be.full_fp32_grads_below_stage is not None and zero < be.full_fp32_grads_below_stage:
        grads = (4 + 2) * p  # the full fp32 buffer and the 16-bit gradients it accumulates
    optimizer = (master + adam) * p / sharded_from(1)
    if offload_optimizer and be.offload:
        optimizer = 0.0
        grads = grads if zero < 2 else 0.0  # reduced gradients stream to host memory
    if offload_param and be.offload:
        weights = 0.0
    return ModelStates(weights, grads, optimizer)


def layer_activation_bytes(
    m: ModelConfig,
    micro_batch: int,
    seq: int,
    tp: int,
    sp: bool,
    dtype_bytes: int,
    flash: bool = True,
    recompute: str = "none",
    moe: bool = False,
    imbalance: float = 1.0,
    eager: bool = False,
) -> float:
    """Bytes one transformer layer (`moe`: a mixture-of-experts layer, its busiest rank
    `imbalance` over the even share) keeps for backward, per micro-batch, on one TP rank. `eager`:
    a transformers layer in eager PyTorch, whose RMSNorms keep their fp32 upcast input and 16-bit
    normalized values besides their output (4 more bytes per value than a fused norm's input:
    LlamaRMSNorm upcasts, and autograd keeps the upcast for pow and mul and the normalized values
    for the weight's mul), and whose SwiGLU keeps silu's output besides its inputs (counted with
    torch.autograd.graph.saved_tensors_hooks in tests/test_layer_dispatches.py)."""
    tokens = micro_batch * seq
    h, d = m.hidden_size, head_dim(m)
    q, kv = m.num_attention_heads * d, kv_heads(m) * d
    gated = 2 if m.activation == "swiglu" else 1
    replicated = 1 / tp if sp else 1.0  # outside the TP region: split only by sequence parallel
    mask = 1 if m.hidden_dropout > 0 else 0  # 1-byte dropout masks
    if recompute == "full":
        return dtype_bytes * tokens * h * replicated  # the layer's input only
    outside = tokens * h * (dtype_bytes * (2 + 1 + 1) + 2 * mask) * replicated  # 2 norm inputs, QKV & MLP inputs
    if moe:
        # fc1 out and fc2 in for router_topk experts per token, their permuted inputs, the shared
        # experts' fc1 out and fc2 in, and the router's fp32 scores and probabilities
        routed = m.moe.router_topk * tokens * (expert_ffn_size(m) * (gated + 1) + h) * dtype_bytes * imbalance
        shared = tokens * (m.moe.shared_expert_size or 0) * (gated + 1) * dtype_bytes
        router = 2 * 4 * tokens * m.moe.num_experts * replicated
        mlp = (routed + shared) / tp + router
    else:
        mlp = tokens * dtype_bytes * m.ffn_hidden_size * (gated + 1) / tp
    if eager:
        mlp += tokens * dtype_bytes * (m.ffn_hidden_size if gated == 2 else 0) / tp  # silu's output
        outside += 2 * 4 * tokens * h * replicated  # two norms' upcast and normalized values
    inside = tokens * dtype_bytes * ((q + 2 * kv) + q) / tp + mlp  # QKV out, proj in, fc1 out, fc2 in
    heads = m.num_attention_heads / tp
    if flash or recompute == "selective":
        core = 4 * heads * seq * micro_batch if flash else 0.0  # fp32 log-sum-exp per row
    else:  # softmax output (+ dropout mask and output)
        core = heads * seq * seq * micro_batch * (dtype_bytes + (1 + dtype_bytes if m.attention_dropout > 0 else 0))
    return outside + inside + core


def loss_logit_bytes(backend: Backend, nbytes: int) -> float:
    """Bytes per logit at the loss's peak: the logits in the activations' dtype, the fp32 upcast
    where the backend's loss keeps it (none is made from fp32 logits) and the fp32 logits-sized
    tensors it makes (Backend.loss_keeps_upcast, loss_fp32_logits)."""
    upcast = 4 if backend.loss_keeps_upcast and nbytes < 4 else 0
    return nbytes + upcast + 4 * backend.loss_fp32_logits


def loss_bytes(backend: Backend, tokens: float, vocab: float, hidden: int, nbytes: int) -> float:
    """Bytes the loss holds at its peak for `tokens` tokens over a `vocab`-wide (per-rank) output
    layer: the logits and what the loss keeps per logit (loss_logit_bytes), or, for a loss that makes
    its logits chunk by chunk (Backend.loss_chunked), what Liger's fused linear cross-entropy
    allocates in the forward pass (ops/fused_linear_cross_entropy.py): the input's and the output
    weight's gradients, in the activations' dtype, one chunk's logits of next_power_of_2(ceil(tokens /
    ceil(vocab / hidden))) tokens, and an fp32 loss per token."""
    if not backend.loss_chunked:
        return tokens * vocab * loss_logit_bytes(backend, nbytes)
    chunk = min(tokens, 2 ** math.ceil(math.log2(max(1.0, math.ceil(tokens / math.ceil(vocab / hidden))))))
    return (tokens * hidden + vocab * hidden + chunk * vocab) * nbytes + 4 * tokens


def inflight_chunks(pp: int, vpp: int, num_microbatches: int, stage: int = 0) -> int:
    """Model chunks whose activations a pipeline stage holds at its peak (Megatron-LM schedules:
    warm-up micro-batches + 1)."""
    if pp == 1:
        return 1
    if vpp == 1:
        return min(num_microbatches, pp - stage)
    return min(num_microbatches * vpp, (pp - stage - 1) * 2 + (vpp - 1) * pp + 1)


@dataclass(frozen=True)
class MemoryEstimate:
    stage: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    buffers: float
    allowance: float  # fragmentation + runtime
    runtime: float = 0.0  # the part of the allowance outside PyTorch's allocator (CUDA context, NCCL)

    @property
    def model_states(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def tensors(self) -> float:
        """What tensors hold at the peak: compare with torch.cuda.max_memory_allocated."""
        return self.model_states + self.activations + self.logits + self.buffers

    @property
    def reserved(self) -> float:
        """What PyTorch's caching allocator holds at the peak: compare with max_memory_reserved."""
        return self.total - self.runtime

    @property
    def total(self) -> float:
        """What the device must have: reserved memory and the runtime's."""
        return self.tensors + self.allowance

    def as_gib(self) -> dict:
        keys = ("weights", "grads", "optimizer", "activations", "logits", "buffers", "allowance")
        return {k: getattr(self, k) / GIB for k in keys} | {"total": self.total / GIB}


def stage_memory(cfg: Config, layout: Layout, stage: int, flash: bool | None = None) -> MemoryEstimate:
    m, p, z, r = cfg.model, cfg.parallel, cfg.zero, cfg.recompute
    on_gpu = cfg.cluster.device == "cuda"
    flash = (on_gpu and cfg.train.attention_backend == "flash") if flash is None else flash
    dtype = cfg.precision.dtype
    nbytes = DTYPE_BYTES[dtype]
    params = layout_stage_params(m, layout, stage)
    backend = backend_of(cfg)
    zero_stage = backend.effective_zero(z.stage)

    def states_of(count: int, shard: int) -> ModelStates:
        offload = (z.offload_optimizer != "none", z.offload_param != "none")
        return model_state_bytes(count, dtype, backend, zero_stage, shard, cfg.precision.grad_reduce_in_fp32, *offload)

    # Megatron's distributed optimizer and ZeRO shard over DP x CP, the experts over expert-dp (each
    # over one optimizer instance's share of them: the state is replicated across instances)
    instances = cfg.comm.optimizer_instances
    states = states_of(params.dense, layout.dp * layout.cp // instances)
    if params.experts:
        states += states_of(params.experts, layout.dims.edp // instances)
    if cfg.comm.hpz_partition_size > 1 and zero_stage >= 3:  # ZeRO++ hpZ: a second copy of the
        # parameters sharded over its group only (Wang et al. 2023, section 4.2)
        states += ModelStates(params.total * nbytes / cfg.comm.hpz_partition_size, 0.0, 0.0)

    seq = layout.seq_length // layout.cp
    # one layer's kept bytes on this stage, by recompute granularity (and MoE: moe, imbalance)
    layer_bytes = partial(
        layer_activation_bytes,
        m,
        layout.micro_batch,
        seq,
        layout.tp,
        p.sequence_parallel,
        nbytes,
        flash,
        eager=backend.eager_norm_activations,
    )
    per_layer = layer_bytes(r.granularity)
    layers_per_chunk = layout.stage_layers[stage] // layout.vpp
    chunks = inflight_chunks(layout.pp, layout.vpp, layout.num_microbatches, stage)
    activations = chunks * layers_per_chunk * per_layer
    imbalance = routing_imbalance(m)
    if params.moe_layers:  # those of the chunk's layers that are MoE layers keep more
        per_moe_layer = layer_bytes(r.granularity, True, imbalance)
        activations += chunks * params.moe_layers / layout.vpp * (per_moe_layer - per_layer)
    tokens = layout.gpu_tokens
    if r.granularity == "full":  # one chunk's layers are live again while recomputed
        activations += r.num_layers * layer_bytes("none", bool(params.moe_layers), imbalance)
    if stage == 0:  # embedding output kept for the first layer's backward
        activations += chunks * tokens * m.hidden_size * nbytes / (layout.tp if p.sequence_parallel else 1)

    logits = 0.0
    if stage == layout.pp - 1:  # the loss's peak: the logits and what the backend's loss holds beside them
        logits = loss_bytes(backend, tokens, layout.padded_vocab_size / layout.tp, m.hidden_size, nbytes)

    buffers = 2 * tokens * m.hidden_size * nbytes  # pipeline send/recv or sequence-parallel all-gather
    if params.moe_layers:  # the token dispatcher's send and receive buffers: router_topk copies of each token
        buffers += 2 * m.moe.router_topk * imbalance * tokens * m.hidden_size * nbytes / layout.tp
    if backend.grad_reduce is GradReduce.ZERO_STAGED and zero_stage >= 1:
        # Gradient reduction buckets (DeepSpeed runtime/zero/stage_1_and_2.py, stage3.py): ZeRO-2/3
        # allocate reduce_bucket_size elements whatever the model's size, ZeRO-2 twice with
        # overlap_comm (setup_buckets: "double buffers", one filling while the other reduces);
        # ZeRO-1 (no contiguous gradients, as parakit emits it) flattens its gradients a bucket
        # at a time, so at most the stage's gradients. Their elements are in the reduction's dtype
        # (fp32 with grad_reduce_in_fp32: communication_data_type; measured at stage 3).
        reduce_bytes = 4 if cfg.precision.grad_reduce_in_fp32 else nbytes
        if zero_stage == 1:  # it reduces after the last backward, once activations and logits are
            # freed: the bucket adds only what exceeds them
            bucket = min(z.reduce_bucket_size, params.total) * reduce_bytes
            buffers += max(0.0, bucket - activations - logits)
        else:
            buffers += (2 if z.overlap_comm and zero_stage == 2 else 1) * z.reduce_bucket_size * reduce_bytes
        # prefetched and live gathered parameters: at least one layer
        if backend.shards_params_from_stage is not None and zero_stage >= backend.shards_params_from_stage:
            buffers += max(z.stage3_prefetch_bucket_size, layer_params(m)) * nbytes
    runtime = CUDA_RUNTIME_BYTES if on_gpu else 0.0
    allowance = FRAGMENTATION * (activations + logits + buffers) + runtime
    if logits and backend.holds_previous_logits and layout.num_microbatches > 1:
        allowance += tokens * layout.padded_vocab_size / layout.tp * nbytes
    return MemoryEstimate(
        stage, states.weights, states.grads, states.optimizer, activations, logits, buffers, allowance, runtime
    )


def peak_memory(cfg: Config, layout: Layout) -> MemoryEstimate:
    """The most loaded rank: first stage (most in-flight activations, embedding), last (logits),
    or the second (most in-flight activations among the full middle stages of an uneven split)."""
    stages = {0, layout.pp - 1} | ({1} if layout.pp > 2 else set())
    return max((stage_memory(cfg, layout, s) for s in stages), key=lambda e: e.total)
