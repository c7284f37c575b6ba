"""Megatron-core configuration objects for a validated configuration.

`megatron_sections` gives plain values (written to megatron.yaml), one section per megatron-core
class: ModelParallelConfig + TransformerConfig fields, OptimizerConfig,
DistributedDataParallelConfig, the OptimizerParamScheduler arguments, and GPTModel arguments.
Plain data only: toolkit.train.megatron_configs turns the sections into the megatron-core objects
(emit imports neither torch nor megatron, so that `parakit generate` runs without them).
"""

from __future__ import annotations

from toolkit.config.schema import Config, expert_ffn_size, is_moe, moe_layer_pattern
from toolkit.plan.backends import kernels_of
from toolkit.plan.layout import Layout
from toolkit.plan.lr_schedule import lr_schedule
from toolkit.plan.parallel_dims import DIMS

# Names as torch spells them, so the YAML stays plain text.
_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}


def megatron_degrees(layout: Layout) -> dict:
    """Every parallel dimension megatron-core is told of, under its name (toolkit.plan.parallel_dims):
    the ModelParallelConfig fields, and parallel_state.initialize_model_parallel's keywords."""
    return {d.megatron: d.megatron_degree(getattr(layout.dims, d.name)) for d in DIMS if d.megatron}


def _model_parallel(cfg: Config, layout: Layout) -> dict:
    dtype = cfg.precision.dtype
    on_cpu = cfg.cluster.device == "cpu"
    return {
        **megatron_degrees(layout),
        "sequence_parallel": cfg.parallel.sequence_parallel,
        "tp_comm_overlap": cfg.parallel.tp_comm_overlap,
        "bf16": dtype in ("bf16", "fp8"),
        "fp16": dtype == "fp16",
        # Megatron-LM keeps model weights in the training dtype; the optimizer holds fp32 masters.
        "params_dtype": _DTYPE[dtype],
        "pipeline_dtype": _DTYPE[dtype],
        "use_cpu_initialization": on_cpu,
        "perform_initialization": True,
        # The fused wgrad accumulation is a CUDA kernel from Transformer Engine/apex.
        "gradient_accumulation_fusion": False,
        # gloo pairs batched isend/irecv wrongly when the previous and next stage are the same
        # peer (pp=2 with vpp): silent ~1e-3 loss errors. Send one at a time on CPU. On GPUs the
        # interleaved schedule posts each chunk's sends before computing the next chunk, as
        # Megatron-LM does by default (megatron/training/arguments.py: --no-overlap-p2p-communication
        # turns it off, and it is off without interleaving); batched sends cannot overlap.
        "overlap_p2p_comm": not on_cpu and layout.vpp > 1,
        "batch_p2p_comm": not on_cpu and layout.vpp == 1,
        "deallocate_pipeline_outputs": True,
        # megatron-core's torch-compiled vocab-parallel cross-entropy (fusions/fused_cross_entropy.py;
        # "te" would be Transformer Engine's): train.kernels, toolkit.plan.backends.kernels_of
        "cross_entropy_loss_fusion": kernels_of(cfg).loss,
        "cross_entropy_fusion_impl": "native",
    }


def _transformer(cfg: Config) -> dict:
    m, r = cfg.model, cfg.recompute
    fused = kernels_of(cfg).layers  # megatron-core's jit-fused element-wise kernels (train.kernels)
    on_gpu = cfg.cluster.device == "cuda"
    swiglu = m.activation == "swiglu"
    return {
        "num_layers": m.num_layers,
        "num_layers_in_first_pipeline_stage": cfg.parallel.first_stage_layers,
        "num_layers_in_last_pipeline_stage": cfg.parallel.last_stage_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.num_kv_heads or m.num_attention_heads,
        "kv_channels": m.head_dim or m.hidden_size // m.num_attention_heads,
        "ffn_hidden_size": m.ffn_hidden_size,
        "hidden_dropout": m.hidden_dropout,
        "attention_dropout": m.attention_dropout,
        "normalization": m.normalization,
        "layernorm_epsilon": m.norm_epsilon,
        "add_bias_linear": m.add_bias_linear,
        "add_qkv_bias": m.add_qkv_bias,
        "gated_linear_unit": swiglu,
        # (left, right): a query sees the keys i-left..i+right, left+1 tokens of the past; a model's
        # sliding_window N (transformers' meaning, masking_utils.sliding_window_overlay) is N of them.
        "window_size": (m.sliding_window - 1, 0) if m.sliding_window else None,
        "activation_func": "silu" if swiglu else str(m.activation),  # SwiGLU = silu gate (Shazeer 2020)
        "init_method_std": m.init_method_std,
        "attention_softmax_in_fp32": True,
        # megatron-core fuses bias + silu or bias + gelu only (TransformerConfig.__post_init__).
        "bias_activation_fusion": fused and (swiglu or (m.add_bias_linear and m.activation == "gelu")),
        "masked_softmax_fusion": fused,
        "bias_dropout_fusion": fused,
        "apply_rope_fusion": False,
        # apex's persistent LayerNorm kernel: parakit builds Transformer Engine's or torch's norms, which have
        # none; Megatron-LM turns it on unless told (and its local spec without apex then refuses the model)
        "persist_layer_norm": False,
        # parakit's "flash" is any fused kernel that stores no s x s scores: megatron-core's `auto` lets
        # Transformer Engine pick FlashAttention or cuDNN's fused attention (its `flash` forces
        # NVTE_FLASH_ATTN=1 NVTE_FUSED_ATTN=0: the separate flash-attn package, and no cuDNN attention
        # on Hopper; models/common/language_module/language_module.py). On CPU: unfused.
        "attention_backend": "auto" if on_gpu and cfg.train.attention_backend == "flash" else "unfused",
        "recompute_granularity": None if r.granularity == "none" else r.granularity,
        "recompute_method": r.method if r.granularity == "full" else None,
        "recompute_num_layers": r.num_layers if r.granularity == "full" else None,
        "recompute_modules": list(r.modules) if r.granularity == "selective" else None,
        "fp8": cfg.precision.fp8_format if cfg.precision.dtype == "fp8" else None,
        "cp_comm_type": str(cfg.parallel.cp_comm_type),
        # A GPU cluster runs Transformer Engine's layers (fused attention, fp8, the tensor-parallel overlap,
        # context parallel), which the planner prices (toolkit.plan.backends: fused element-wise work) and
        # parakit's trainer builds where TE is installed (toolkit.train.megatron_model.layer_spec). In
        # megatron-core the field picks the spec only for Megatron-LM's GPT builder (gpt_builders.py), whose
        # local spec refuses context parallel ("only supported by TEDotProductAttention").
        "transformer_impl": "transformer_engine" if on_gpu else "local",
        "qk_layernorm": m.qk_layernorm,
        **_moe(cfg),
    }


def _moe(cfg: Config) -> dict:
    """TransformerConfig's moe_* fields (megatron-core transformer_config.py); none for a dense model."""
    m, moe = cfg.model, cfg.model.moe
    if not is_moe(m):
        return {}
    balancing = "none" if moe.load_balancing in ("expert_bias", "none") else str(moe.load_balancing)
    return {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.router_topk,
        # megatron-core's default (topk then softmax) renormalises the chosen experts' weights;
        # pre-softmax keeps the full softmax's weights (HF norm_topk_prob=false)
        "moe_router_pre_softmax": not moe.norm_topk_prob,
        "moe_router_score_function": str(moe.score_function),
        "moe_ffn_hidden_size": expert_ffn_size(m),
        "moe_shared_expert_intermediate_size": moe.shared_expert_size,
        "moe_shared_expert_gate": moe.shared_expert_gate,
        "moe_layer_freq": moe_layer_pattern(m),
        "moe_router_load_balancing_type": balancing,
        "moe_aux_loss_coeff": moe.aux_loss_coeff if balancing != "none" else 0.0,
        "moe_z_loss_coeff": moe.z_loss_coeff,
        "moe_router_enable_expert_bias": moe.load_balancing == "expert_bias",
        "moe_router_bias_update_rate": moe.expert_bias_update_rate,
        "moe_expert_capacity_factor": moe.capacity_factor,
        "moe_token_drop_policy": str(moe.token_drop_policy),
        "moe_pad_expert_input_to_capacity": moe.pad_to_capacity,
        "moe_token_dispatcher_type": str(moe.token_dispatcher),  # flex: megatron-core's default backend, DeepEP
        "moe_grouped_gemm": moe.grouped_gemm,
        # the router's scores and the weighted sum of the experts' outputs in fp32 (Megatron-LM
        # recommends it for training stability: docs moe README, --moe-router-dtype)
        "moe_router_dtype": "fp32",
    }


def _optimizer(cfg: Config, layout: Layout) -> dict:
    o, pr = cfg.optim, cfg.precision
    static = pr.dtype == "fp16" and pr.loss_scaling == "static"
    return {
        "optimizer": "adam",  # megatron-core's Adam applies decoupled weight decay (AdamW)
        "lr": layout.lr,
        "min_lr": layout.min_lr,
        "weight_decay": o.weight_decay,
        "adam_beta1": o.beta1,
        "adam_beta2": o.beta2,
        "adam_eps": o.eps,
        "clip_grad": o.clip_grad,
        "bf16": pr.dtype in ("bf16", "fp8"),
        "fp16": pr.dtype == "fp16",
        "params_dtype": _DTYPE[pr.dtype],
        "loss_scale": pr.loss_scale if static else None,  # None: dynamic
        "initial_loss_scale": float(2**pr.initial_scale_power),
        "min_loss_scale": pr.min_loss_scale,
        "loss_scale_window": float(pr.loss_scale_window),
        "hysteresis": pr.hysteresis,
        "use_distributed_optimizer": cfg.zero.stage == 1,
    }


def _ddp(cfg: Config) -> dict:
    # Gradient reduction and the distributed optimizer's parameter all-gather overlap with the
    # backward and the next forward (Megatron-LM --overlap-grad-reduce --overlap-param-gather). On
    # CPU too: gloo runs the collectives asynchronously, and the CPU path stays the GPU's path.
    overlap = cfg.zero.overlap_comm
    distributed = cfg.zero.stage == 1
    return {
        "grad_reduce_in_fp32": cfg.precision.grad_reduce_in_fp32,
        "overlap_grad_reduce": overlap,
        "overlap_param_gather": overlap and distributed,
        "use_distributed_optimizer": distributed,
        # shard the optimizer inside comm.optimizer_instances groups of the dp x cp ranks, replicate across them
        "num_distributed_optimizer_instances": cfg.comm.optimizer_instances,
        "bucket_size": cfg.comm.bucket_size,
        # parakit's trainer checks loss and gradients on every rank together and stops or skips
        # (train.fault.nan_action); megatron-core's check raises inside the backward pass on the
        # ranks that hold the NaN only.
        "check_for_nan_in_grad": False,
    }


def _scheduler(cfg: Config, layout: Layout) -> dict:
    """Arguments of megatron.core.optimizer_param_scheduler.OptimizerParamScheduler: the schedule of
    toolkit.plan.lr_schedule, which the deepspeed backend steps itself."""
    schedule = lr_schedule(cfg, layout)
    return {
        "init_lr": 0.0,
        "max_lr": schedule.max_lr,
        "min_lr": schedule.min_lr,
        "lr_warmup_steps": schedule.warmup_steps,
        "lr_decay_steps": schedule.decay_steps,
        "lr_decay_style": schedule.style,
        "start_wd": cfg.optim.weight_decay,
        "end_wd": cfg.optim.weight_decay,
        "wd_incr_steps": layout.steps,
        "wd_incr_style": "constant",
    }


def _gpt_model(cfg: Config, layout: Layout) -> dict:
    m = cfg.model
    return {
        "vocab_size": layout.padded_vocab_size,
        # Megatron-LM passes --max-position-embeddings here (the learned position table's size).
        "max_sequence_length": m.max_position_embeddings,
        "position_embedding_type": m.position_embedding,
        "rotary_base": m.rotary_base,
        # llama3 scaling: megatron-core takes the factor; the validator (rope_scaling_backend) holds the
        # other parameters at the values megatron-core applies (toolkit.plan.backends).
        "rope_scaling": m.rope_scaling.type == "llama3",
        "rope_scaling_factor": m.rope_scaling.factor if m.rope_scaling.type == "llama3" else None,
        "share_embeddings_and_output_weights": m.tie_embeddings,
        "parallel_output": True,
    }


def _training(cfg: Config, layout: Layout) -> dict:
    return {
        "world_size": layout.world_size,
        "data_parallel_size": layout.dp,
        "global_batch_size": layout.global_batch,
        "micro_batch_size": layout.micro_batch,
        "num_microbatches": layout.num_microbatches,
        "seq_length": layout.seq_length,
        "train_iters": layout.steps,
        "seed": cfg.train.seed,
        "log_interval": cfg.train.log_interval,
    }


def megatron_sections(cfg: Config, layout: Layout) -> dict:
    return {
        "model_parallel": _model_parallel(cfg, layout),
        "transformer": _transformer(cfg),
        "optimizer": _optimizer(cfg, layout),
        "ddp": _ddp(cfg),
        "scheduler": _scheduler(cfg, layout),
        "gpt_model": _gpt_model(cfg, layout),
        "training": _training(cfg, layout),
    }
