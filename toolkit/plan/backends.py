"""What each training backend supports and how it behaves, described once.

The validator, the memory and step-time models, the layout search, the emitters and the trainer's
dispatch read these descriptions; nothing else in parakit tests a backend's name. Adding a backend
means one description here plus one trainer module that implements toolkit.train.loop's
BackendSteps protocol, registered by the name on the train side (toolkit.train.backends).

Pure Python (no torch): the planner reads it on a laptop.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple


class GradReduce(StrEnum):
    """How a backend's data-parallel gradient reduction meets the backward pass."""

    # Megatron DDP (overlap_grad_reduce): gradients are reduced in buckets while the last
    # micro-batch's backward runs; the distributed optimizer all-gathers updated parameters
    # during the next forward.
    OVERLAPPED_BUCKETS = "overlapped_buckets"
    # DeepSpeed: ZeRO 0/1 reduce once per step after the last backward; ZeRO-2/3 reduce-scatter
    # every micro-batch, overlapped with its backward (overlap_comm).
    ZERO_STAGED = "zero_staged"


@dataclass(frozen=True)
class Package:
    """A package an option needs on the machines that train: without it megatron-core or DeepSpeed
    would replace the option silently, or refuse it only once the ranks run."""

    module: str  # what the run imports, e.g. "transformer_engine.pytorch"
    install: str  # what to install, e.g. "transformer-engine[pytorch]"
    field: str  # the option that needs it ...
    value: str  # ... at this value (or, with `when`, where `when` holds: value then says when in words)
    why: str
    instead: str  # the option's alternative without the package
    # Needed only where this also holds of the configuration (e.g. the option resolves to the kernels
    # that need it on this cluster); None: wherever the option has the value.
    when: Callable[[object], bool] | None = None

    @property
    def name(self) -> str:
        return self.module.split(".")[0]

    def needed(self, cfg) -> bool:
        if self.when is not None:
            return self.when(cfg)
        value = cfg
        for key in self.field.split("."):
            value = getattr(value, key)
        return str(value) == self.value


# megatron-core without TE builds its local spec, which has no fp8 GEMMs: the model would run in bf16
# while the planner predicts fp8 speed (TransformerConfig(fp8=...) is honoured by TE's modules only).
TRANSFORMER_ENGINE_FP8 = Package(
    module="transformer_engine.pytorch",
    install="transformer-engine[pytorch]",
    field="precision.dtype",
    value="fp8",
    why="fp8 matrix multiplies and their scaling recipes are Transformer Engine's",
    instead="precision=bf16",
)
# The overlap is Transformer Engine's (userbuffers and its GEMM kernels that exchange chunks):
# megatron-core's local spec has no such layers and would run the collectives exposed.
TRANSFORMER_ENGINE_TP_OVERLAP = Package(
    module="transformer_engine.pytorch",
    install="transformer-engine[pytorch]",
    field="parallel.tp_comm_overlap",
    value="True",
    why="the tensor-parallel communication/GEMM overlap runs in Transformer Engine's userbuffers",
    instead="parallel.tp_comm_overlap=false",
)


# megatron-core's grouped GEMM over the local experts is Transformer Engine's GroupedLinear (its
# local spec's GroupedMLP needs the CUDA-only grouped_gemm package instead).
TRANSFORMER_ENGINE_GROUPED_GEMM = Package(
    module="transformer_engine.pytorch",
    install="transformer-engine[pytorch]",
    field="model.moe.grouped_gemm",
    value="True",
    why="the experts' grouped GEMM is Transformer Engine's GroupedLinear",
    instead="model.moe.grouped_gemm=false",
)
# megatron-core's flex dispatcher runs DeepEP's fused dispatch/combine kernels (token_dispatcher.py,
# MoEFlexTokenDispatcher); DeepEP is built from source against the machine's CUDA and NVSHMEM.
DEEP_EP = Package(
    module="deep_ep",
    install="deep_ep (built from github.com/deepseek-ai/DeepEP)",
    field="model.moe.token_dispatcher",
    value="flex",
    why="the flex dispatcher runs DeepEP's kernels",
    instead="model.moe.token_dispatcher=alltoall",
)


class KernelSetting(NamedTuple):
    """What the kernels a run computes with depend on (toolkit.plan.backends.kernels_of)."""

    backend: str
    choice: str  # train.kernels
    device: str
    dtype: str
    zero: int
    pp: int
    family: str
    experts: int


@dataclass(frozen=True)
class FusedKernels:
    """A backend's fused element-wise kernels and fused loss, against the reference PyTorch ones."""

    layers: str  # what computes the layers' element-wise work, fused ...
    reference_layers: str  # ... and unfused
    loss: str
    reference_loss: str
    layers_blocked: Callable[[KernelSetting], str | None]  # why a configuration cannot have the fused layers
    loss_blocked: Callable[[KernelSetting], str | None]
    layer_traits: tuple[tuple[str, object], ...]  # (Backend field, value) under the fused layers
    loss_traits: tuple[tuple[str, object], ...]  # ... and under the fused loss


# Liger's kernels are Triton's (liger-kernel's optional extra "gpu" of parakit: pyproject.toml).
LIGER = Package(
    module="liger_kernel.transformers",
    install="liger-kernel==0.8.5",
    field="train.kernels",
    value="fused (or auto on GPUs)",
    why="the deepspeed backend's fused kernels are Liger's",
    instead="train.kernels=reference",
    when=lambda cfg: (lambda k: k.layers or k.loss)(kernels_of(cfg)),
)


@dataclass(frozen=True)
class MoeSupport:
    """What of a mixture-of-experts model a backend trains."""

    # Its MoE layers are the model family's transformers modules, which express only some of
    # model.moe's settings (toolkit.families.base.Family.unexpressed); else megatron-core's MoELayer.
    family_modules: bool
    grouped_gemm: bool  # all local experts in one grouped GEMM
    pipeline: bool  # MoE layers on pipeline stages (pp > 1)


@dataclass(frozen=True)
class Backend:
    name: str
    summary: str
    # ZeRO stages it runs, and what a stage means there.
    zero_stages: tuple[int, ...]
    zero_meaning: str
    pipeline_zero_stages: tuple[int, ...]  # stages allowed together with pipeline parallel
    # of {"tp", "pp", "vpp", "cp", "sp", "ep", "etp"} and "tp_overlap" (tensor-parallel communication overlapped
    # with the GEMMs); dp always
    parallel_dims: frozenset[str]
    moe: MoeSupport | None  # mixture-of-experts models (model.moe.num_experts); None: dense only
    # the data-parallel traffic options (toolkit.config.schema.CommConfig fields) it honours
    comm_options: frozenset[str]
    # why it does not train with a dimension, where the reason is not the obvious one: (dim, why)
    lacks: tuple[tuple[str, str], ...]
    recompute: tuple[str, ...]  # recompute granularities
    precisions: tuple[str, ...]
    offload: bool  # ZeRO optimizer/parameter offload
    # Pipeline limits.
    uneven_pipeline_stages: bool  # parallel.first_stage_layers / last_stage_layers
    pipeline_tied_embeddings: bool
    pipeline_sliding_window: bool
    # Model and numerics.
    pads_vocab: bool  # embedding padded to make_vocab_size_divisible_by * tp (Megatron-LM)
    # precision.grad_reduce_in_fp32 in 16-bit training: every backend reduces in fp32; gradients are
    # held (accumulated) in fp32 from this ZeRO stage on, ...
    fp32_grads_from_stage: int | None
    # ... and below this stage in a full (unsharded) fp32 copy beside the 16-bit gradients.
    full_fp32_grads_below_stage: int | None
    fp32_master_from_stage: int | None  # keeps an fp32 master copy even for fp32 params from this ZeRO stage
    shards_grads_from_stage: int | None  # ZeRO stage from which gradients are sharded over dp
    shards_params_from_stage: int | None  # ... and parameters
    nan_skip_needs_overflow_check: bool  # a NaN step is dropped only by an optimizer that checks for overflow
    # llama3 RoPE scaling parameters (model.rope_scaling.*) the backend cannot set, with the only
    # value it applies; empty: every parameter is honoured.
    rope_scaling_fixed: tuple[tuple[str, float], ...]
    # Performance model.
    # The layers' element-wise work (norms, RoPE, activation, residual adds): False, fused kernels
    # moving the bytes toolkit.plan.perf's fused count gives; True, the eager PyTorch passes of a
    # transformers model (toolkit.plan.kernels.EAGER_LAYER_BYTES).
    eager_layers: bool
    # Operations the PyTorch dispatcher runs (views and autograd's backward ops included) per layer
    # and micro-batch, forward and backward with the gradient hooks, and per layer and optimizer
    # step beside a fixed number per step: what the host issues (cluster.op_dispatch_s each),
    # counted in the backend's training loop on one CPU rank by tests/test_layer_dispatches.py.
    layer_dispatches: int
    step_dispatches_per_layer: int
    step_dispatches: int
    # The Adam kernel it steps where the machines have Transformer Engine (cluster.transformer_engine)
    # and where they have a plain CUDA torch: "fused" (one pass: torch's fused AdamW, apex's or
    # Transformer Engine's FusedAdam) or "foreach" (torch's multi-tensor AdamW, a pass per operation).
    adam: str
    plain_torch_adam: str
    # The loss on the last stage: passes over the fp32 logits (reads and writes, forward and
    # backward; a 16-bit run adds the upcast and the gradient's downcast), and new logits-sized
    # tensors it allocates (the logits included).
    loss_logit_passes: int
    loss_fresh_logits: int
    # Whether those passes run on an fp32 upcast of 16-bit logits (False: at the logits' own dtype,
    # nothing upcast), and whether the loss makes its logits chunk by chunk of tokens from the last
    # hidden states and the output weight, never all of them at once (toolkit.plan.memory.loss_bytes).
    loss_upcasts: bool
    loss_chunked: bool
    # What the loss holds per logit at its peak, beside the 16-bit logits: its fp32 upcast kept
    # through the loss (worked on in place), and further fp32 logits-sized tensors.
    loss_keeps_upcast: bool
    loss_fp32_logits: int
    # Whether the trainer holds a micro-batch's 16-bit logits until the next micro-batch's forward
    # has returned: the caching allocator then keeps their freed block, which the loss's fp32
    # requests cannot reuse, beside the loss's own blocks (reserved, not allocated, at the peak).
    holds_previous_logits: bool
    # Bytes per parameter and micro-batch that adding a micro-batch's 16-bit gradient into the fp32
    # gradient moves besides the weight-gradient GEMM's own write (16-bit training).
    grad_accumulation_bytes: int
    # Whether the model's norms are eager transformers RMSNorms (autograd keeps their fp32 upcast
    # input and 16-bit normalized values besides the output) and its gated activation eager
    # (silu's output kept besides its inputs); toolkit.plan.memory.layer_activation_bytes.
    eager_norm_activations: bool
    grad_reduce: GradReduce
    # The fused kernels it computes with under train.kernels (fused, or auto on GPUs): named for the
    # run's summary, why a configuration cannot have them (None: it can), and the traits above that
    # change with them (toolkit.plan.backends.backend_of applies them).
    fused: FusedKernels
    # Checkpoints, weights and launch.
    checkpoint_format: str
    async_save: bool
    # The weight formats (toolkit.formats.hf_files.FORMATS) it starts from in a Hugging Face model
    # directory (model.hf_path), in the order it looks for them; empty: none.
    hf_weights: tuple[str, ...]
    megatron_lm_entry: bool  # launch.sh can run Megatron-LM's pretrain_gpt.py instead of parakit's trainer
    # train.init_checkpoint / train.save_init_checkpoint: initial weights as a megatron-core dist checkpoint
    dist_init_weights: bool
    # Packages that options need where the run trains (checked there before any rank starts).
    packages: tuple[Package, ...] = ()

    def effective_zero(self, stage: int) -> int:
        """The ZeRO stage this backend actually runs for `zero.stage` (the highest it has)."""
        return min(stage, max(self.zero_stages))

    def optimizer_sharding(self, stage: int) -> str:
        """How the memory-saving option reads in reports ("ZeRO-2", "distributed optimizer")."""
        stage = self.effective_zero(stage)
        if not stage:
            return ""
        return f"ZeRO-{stage}" if max(self.zero_stages) > 1 else "distributed optimizer"


MEGATRON = Backend(
    name="megatron",
    summary="megatron-core GPTModel, TP/PP/VPP/CP/SP, interleaved 1F1B, distributed optimizer",
    zero_stages=(0, 1),
    zero_meaning="stage 1 is Megatron's distributed optimizer (optimizer state sharded over dp x cp)",
    pipeline_zero_stages=(0, 1),
    parallel_dims=frozenset({"tp", "pp", "vpp", "cp", "sp", "tp_overlap", "ep", "etp"}),
    moe=MoeSupport(family_modules=False, grouped_gemm=True, pipeline=True),
    comm_options=frozenset({"optimizer_instances", "bucket_size"}),  # DistributedDataParallelConfig
    lacks=(),
    recompute=("none", "selective", "full"),
    precisions=("fp32", "bf16", "fp16", "fp8"),
    offload=False,
    uneven_pipeline_stages=True,
    pipeline_tied_embeddings=True,
    pipeline_sliding_window=True,
    pads_vocab=True,
    fp32_grads_from_stage=0,  # DDP's fp32 main_grad buffers
    full_fp32_grads_below_stage=None,
    fp32_master_from_stage=None,
    shards_grads_from_stage=None,
    shards_params_from_stage=None,
    nan_skip_needs_overflow_check=False,  # parakit checks the gradient buffers itself
    # megatron-core 0.19 takes only rope_scaling + rope_scaling_factor: RotaryEmbedding._apply_scaling
    # keeps the other llama3 parameters at these defaults (and so does Megatron-LM's --use-rope-scaling).
    rope_scaling_fixed=(
        ("low_freq_factor", 1.0),
        ("high_freq_factor", 4.0),
        ("original_max_position_embeddings", 8192),
    ),
    # Fused element-wise kernels: with Transformer Engine its own; without it (local spec) torch's
    # RMSNorm and megatron-core's SwiGLU and RoPE, which on the H200 without Transformer Engine
    # ran within 1.5% of the fused count's step (scripts/data/gpu_measured_points.yaml).
    eager_layers=False,
    layer_dispatches=265,
    # the distributed optimizer's per-parameter copies and megatron-core's local multi_tensor_applier
    # (norm, scale) loop over every tensor without apex or Transformer Engine
    step_dispatches_per_layer=112,
    step_dispatches=97,
    adam="fused",  # Transformer Engine's FusedAdam
    plain_torch_adam="foreach",  # megatron-core optimizer/__init__.py: Adam = torch.optim.AdamW
    # megatron-core's vocab-parallel cross entropy works in place on the fp32 upcast of the logits
    # (tensor_parallel/cross_entropy.py): max, subtract, exp, sum, divide forward (7 passes),
    # target update and scale backward (2); only the logits themselves are a new tensor. At its
    # peak the 16-bit logits (still referenced by GPTModel.forward) and the upcast are alive.
    loss_logit_passes=9,
    loss_fresh_logits=1,
    loss_upcasts=True,
    loss_chunked=False,
    loss_keeps_upcast=True,
    loss_fp32_logits=0,
    holds_previous_logits=False,  # GPTModel returns the loss; the schedule keeps no logits
    # DDP's backward hook: param.main_grad.add_(param.grad) (megatron-core distributed/
    # param_and_grad_buffer.py; gradient_accumulation_fusion is off in parakit's runs, it needs
    # apex or Transformer Engine): reads the 16-bit and the fp32 gradient, writes the fp32 one.
    grad_accumulation_bytes=2 + 4 + 4,
    eager_norm_activations=False,
    grad_reduce=GradReduce.OVERLAPPED_BUCKETS,
    fused=FusedKernels(
        layers="megatron-core fusions (bias-activation, bias-dropout; Transformer Engine's layers where installed)",
        reference_layers="PyTorch operations",
        loss="megatron-core fused vocab-parallel cross-entropy (native)",
        reference_loss="megatron-core vocab-parallel cross-entropy",
        layers_blocked=lambda s: None,
        # fusions/fused_cross_entropy.py calculate_gradients returns the logits' gradient in bf16
        loss_blocked=lambda s: (
            None
            if s.dtype in ("bf16", "fp8")
            else f"megatron-core's fused cross-entropy returns bf16 gradients (precision.dtype={s.dtype})"
        ),
        # the fused layers' bytes are the planner's fused count either way (eager_layers above)
        layer_traits=(),
        # torch-compiled in three forward functions and one backward (megatron-core
        # fusions/fused_cross_entropy.py): the max with the upcast, subtract-exp-sum in place (read and
        # write), the division (read and write), the gradient in place (read and write) and its
        # downcast: 5 fp32 passes beside the upcast and downcast (9 unfused). Memory as unfused.
        loss_traits=(("loss_logit_passes", 5),),
    ),
    # every rank writes its own shards; another tp/pp/vpp/cp/ep converts once (toolkit.train.megatron_reshard)
    checkpoint_format="megatron-core dist_checkpointing, fully parallel, dp_reshardable (loads at any layout)",
    async_save=True,
    hf_weights=("safetensors",),  # read into each rank's chunks at any layout (toolkit.families.hf_weights)
    megatron_lm_entry=True,
    dist_init_weights=True,  # megatron_backend's setup loads or saves them
    # Context parallel, sequence parallel and sliding windows run without TE (toolkit.train's local spec).
    packages=(TRANSFORMER_ENGINE_FP8, TRANSFORMER_ENGINE_TP_OVERLAP, TRANSFORMER_ENGINE_GROUPED_GEMM, DEEP_EP),
)

DEEPSPEED = Backend(
    name="deepspeed",
    summary="transformers models under DeepSpeed ZeRO 0-3 with offload, DeepSpeed pipeline (1F1B)",
    zero_stages=(0, 1, 2, 3),
    zero_meaning="ZeRO stages 1-3 shard optimizer state, then gradients, then parameters",
    pipeline_zero_stages=(0, 1),  # DeepSpeed's PipelineEngine
    parallel_dims=frozenset({"pp"}),
    # transformers' MoE blocks under ZeRO 0-3, the routers' losses added by parakit
    # (toolkit.train.router_losses). No expert parallel: DeepSpeed's own MoE layer (deepspeed.moe)
    # gates and balances its own way (its top-1/top-2 gates and loss, sharded_moe.py) and refuses
    # ZeRO-3 (runtime/engine.py), and its AutoEP fails on transformers 5's MoE blocks. No pipeline:
    # the routers' logits would have to travel with the activations through DeepSpeed's
    # PipelineModule, which passes the hidden states only.
    moe=MoeSupport(family_modules=True, grouped_gemm=False, pipeline=False),
    comm_options=frozenset({"hpz_partition_size", "quantized_weights", "quantized_gradients"}),  # ZeRO++
    lacks=(
        (
            "ep",
            "DeepSpeed's own MoE layer gates and balances its own way and refuses ZeRO-3, and its AutoEP fails "
            "on transformers 5's MoE blocks",
        ),
    ),
    recompute=("none", "full"),  # transformers models checkpoint whole layers
    precisions=("fp32", "bf16", "fp16"),
    offload=True,
    uneven_pipeline_stages=False,  # PipelineModule balances the decoder layers itself
    pipeline_tied_embeddings=False,
    pipeline_sliding_window=False,
    pads_vocab=False,  # transformers embeddings are not padded
    # ZeRO-0 accumulates in the model's dtype (toolkit.emit.deepspeed); ZeRO-1 keeps a full fp32
    # gradient buffer beside the 16-bit gradients (bf16: BF16_Optimizer's fp32_groups_gradients_flat;
    # fp16: the stage-1 optimizer's grad_accum attribute); ZeRO-2/3 accumulate their fp32 partition.
    fp32_grads_from_stage=1,
    full_fp32_grads_below_stage=2,
    fp32_master_from_stage=1,
    shards_grads_from_stage=1,
    shards_params_from_stage=3,
    nan_skip_needs_overflow_check=True,
    rope_scaling_fixed=(),  # transformers reads every llama3 parameter from rope_parameters
    # transformers' Llama layer in eager PyTorch: RMSNorm as upcast, pow, mean, rsqrt, mul, downcast,
    # mul; RoPE as slices, neg, cat, mul, add; SwiGLU as silu, mul; each a kernel of its own.
    eager_layers=True,
    layer_dispatches=264,
    step_dispatches_per_layer=18,
    step_dispatches=113,
    adam="fused",  # toolkit.emit.deepspeed: torch_adam with fused=True on GPUs, either way
    plain_torch_adam="fused",
    # torch's cross_entropy (log_softmax + nll_loss): log_softmax reads the logits twice and writes
    # its output, nll_loss's backward writes a zeroed gradient, log_softmax's backward reads it
    # and the output and writes the logits' gradient (8 passes); the logits, the log-probabilities
    # and the two gradients are new tensors. At the peak (log_softmax's backward) the 16-bit logits
    # (the model's output, held by the trainer), the log-probabilities, their gradient and the
    # logits' fp32 gradient are alive; the upcast was freed once log_softmax read it.
    loss_logit_passes=8,
    loss_fresh_logits=4,
    loss_upcasts=True,
    loss_chunked=False,
    loss_keeps_upcast=False,
    loss_fp32_logits=3,
    holds_previous_logits=True,  # toolkit.train.deepspeed_backend: `out` lives until rebound
    # ZeRO-1 in bf16 (BF16_Optimizer, runtime/bf16_optimizer.py _update_hp_grad):
    # hp_grad.add_(lp.grad.to(float32)) then lp.grad.zero_(): an upcast (2 read, 4 written), the add
    # (4 + 4 read, 4 written) and the zeroing (2 written).
    grad_accumulation_bytes=6 + 12 + 2,
    eager_norm_activations=True,
    grad_reduce=GradReduce.ZERO_STAGED,
    fused=FusedKernels(
        layers="Liger RMSNorm, RoPE and SwiGLU",
        reference_layers="transformers eager PyTorch operations",
        loss="Liger fused linear cross-entropy (logits in chunks, never all at once)",
        reference_loss="torch cross_entropy over the logits",
        layers_blocked=lambda s: _liger_family_blocked(s),
        loss_blocked=lambda s: _liger_loss_blocked(s),
        # Liger's RMSNorm keeps its 16-bit input and a per-row rstd, its SwiGLU the two inputs (the
        # activation recomputed in backward), each one Triton kernel: the fused count of bytes
        layer_traits=(("eager_layers", False), ("eager_norm_activations", False)),
        # Liger ops/fused_linear_cross_entropy.py: per chunk of tokens, the chunk's logits GEMM, one
        # Triton kernel that reads each row twice (online max and sum, then the gradient written in
        # place) at the logits' dtype, and the input and weight gradients' GEMMs in the forward pass
        loss_traits=(
            ("loss_logit_passes", 3),
            ("loss_fresh_logits", 0),
            ("loss_upcasts", False),
            ("loss_chunked", True),
            ("loss_keeps_upcast", False),
            ("loss_fp32_logits", 0),
            ("holds_previous_logits", False),
        ),
    ),
    checkpoint_format="DeepSpeed engine checkpoint (zero_to_fp32 consolidates it)",
    async_save=False,
    # transformers' from_pretrained (modeling_utils._get_resolved_checkpoint_files): safetensors first
    hf_weights=("safetensors", "pytorch_bin"),
    megatron_lm_entry=False,
    dist_init_weights=False,  # its models start from model.hf_path or a seeded init
    packages=(LIGER,),
)

BACKENDS: dict[str, Backend] = {b.name: b for b in (MEGATRON, DEEPSPEED)}

# The dense families whose transformers modules Liger replaces (liger_kernel.transformers.monkey_patch:
# apply_liger_kernel_to_llama, _mistral, _qwen2, _qwen3 swap the RMSNorm and MLP classes and RoPE).
LIGER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def _liger_family_blocked(s: KernelSetting) -> str | None:
    if s.family not in LIGER_FAMILIES or s.experts:
        return f"parakit has Liger's kernels for the dense {', '.join(LIGER_FAMILIES)} models (model.family={s.family})"
    return None


def _liger_loss_blocked(s: KernelSetting) -> str | None:
    if s.zero >= 3:
        # Liger reads lm_head.weight outside the module's forward, where ZeRO-3 holds only a shard
        return "Liger's fused loss reads the output weight outside its module, which ZeRO-3 partitions (zero.stage=3)"
    if s.pp > 1:
        return "DeepSpeed's pipeline computes the loss in its own loss function (parallel.pp > 1)"
    return _liger_family_blocked(s)


@dataclass(frozen=True)
class Kernels:
    """The kernels a configuration computes with: fused or reference, for the layers and the loss."""

    layers: bool
    loss: bool
    names: dict  # {"layers": ..., "loss": ...}: what computes them, for the run's summary
    kept_reference: tuple[str, ...]  # why a part asked to be fused stays the reference one


def kernels_of(cfg) -> Kernels:
    """train.kernels resolved for the configuration's backend and cluster: `auto` fuses on GPUs."""
    m = cfg.model
    # the fields as they are: StrEnum members hash and compare as their text
    setting = KernelSetting(
        cfg.backend.name,
        cfg.train.kernels,
        cfg.cluster.device,
        cfg.precision.dtype,
        cfg.zero.stage,
        cfg.parallel.pp,
        m.family,
        m.moe.num_experts or 0,
    )
    return _resolved(setting)


@functools.lru_cache(maxsize=256)  # the layout search asks for every layout it prices
def _resolved(s: KernelSetting) -> Kernels:
    fused = backend_named(s.backend).fused
    wanted = s.choice == "fused" or (s.choice == "auto" and s.device == "cuda")
    why_layers = fused.layers_blocked(s) if wanted else None
    why_loss = fused.loss_blocked(s) if wanted else None
    layers, loss = wanted and why_layers is None, wanted and why_loss is None
    return Kernels(
        layers,
        loss,
        {
            "layers": fused.layers if layers else fused.reference_layers,
            "loss": fused.loss if loss else fused.reference_loss,
        },
        tuple(dict.fromkeys(why for why in (why_layers, why_loss) if why)),
    )


def backend_named(name: str) -> Backend:
    """The description of backend `name`; an unknown name lists the known ones."""
    try:
        return BACKENDS[str(name)]
    except KeyError:
        close = difflib.get_close_matches(str(name), BACKENDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown backend {name!r}{hint}; known backends: {', '.join(BACKENDS)}") from None


def backend_of(cfg) -> Backend:
    """The description of the configuration's backend (`backend.name`), with the traits of the
    kernels train.kernels resolves to (kernels_of)."""
    backend = backend_named(cfg.backend.name)
    kernels = kernels_of(cfg)
    if not (kernels.layers or kernels.loss):
        return backend
    return _with_kernels(backend, kernels.layers, kernels.loss)


# (id of a description, layers, loss) -> (that description, it with the fused kernels' traits): the
# layout search asks for the same few for every layout it prices
_FUSED: dict[tuple[int, bool, bool], tuple[Backend, Backend]] = {}


def _with_kernels(backend: Backend, layers: bool, loss: bool) -> Backend:
    key = (id(backend), layers, loss)
    kept = _FUSED.get(key)
    if kept is None or kept[0] is not backend:  # a description replaced since (tests swap them)
        traits = dict((backend.fused.layer_traits if layers else ()) + (backend.fused.loss_traits if loss else ()))
        kept = _FUSED[key] = (backend, dataclasses.replace(backend, **traits))
    return kept[1]


def logs_to(cfg, tracker: str) -> bool:
    """Whether train.loggers names `tracker`."""
    return tracker in map(str, cfg.train.loggers)


def _logs_to(tracker: str) -> Callable[[object], bool]:
    return lambda cfg: logs_to(cfg, tracker)


def mlflow_store(cfg) -> str | None:
    """The MLflow tracking URI a run logs to: train.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI;
    None: a SQLite store in the run directory (toolkit.train.trackers.mlflow_tracking_uri)."""
    return cfg.train.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")


def _mlflow_sqlite(cfg) -> bool:
    """MLflow's SQLite store (parakit's default) is SQLAlchemy's."""
    return logs_to(cfg, "mlflow") and (mlflow_store(cfg) or "sqlite:").startswith("sqlite:")


def _tracker(logger: str, install: str, whose: str) -> Package:
    return Package(
        module=logger,
        install=install,
        field="train.loggers",
        value=f"with {logger}",
        why=f"train.loggers' {logger} is {whose} own package",
        instead=f"drop {logger} from train.loggers",
        when=_logs_to(logger),
    )


# The trackers of train.loggers (parakit's optional extra "trackers": pyproject.toml).
TRACKER_PACKAGES = (
    _tracker("wandb", "wandb==0.31.0", "Weights & Biases'"),
    _tracker("mlflow", "mlflow-skinny==3.18.0", "MLflow's"),
    Package(
        module="alembic",
        install="alembic==1.20.1 sqlalchemy==2.0.59",
        field="train.mlflow_tracking_uri",
        value="a SQLite store (null: <run dir>/mlflow.db)",
        why="MLflow's SQLite store is SQLAlchemy's, created by alembic",
        instead="set train.mlflow_tracking_uri to an MLflow server (http://HOST:5000)",
        when=_mlflow_sqlite,
    ),
)


def packages_needed(cfg) -> list[Package]:
    """The packages the configuration's options need on the machines that train."""
    return [package for package in (*backend_of(cfg).packages, *TRACKER_PACKAGES) if package.needed(cfg)]


def supporting(feature) -> list[str]:
    """Names of the backends for which `feature(backend)` holds (for fixes: "or backend=megatron")."""
    return [b.name for b in BACKENDS.values() if feature(b)]
