"""What DeepSpeed reads back from parakit's deepspeed.json, against what the configuration asks for.

TABLE holds, for every leaf key path toolkit.emit.deepspeed can write, (held, asked): held reads
the value DeepSpeed 0.19 holds from its DeepSpeedConfig (the attribute its engine uses later);
asked computes the value the parakit configuration means from the configuration and its layout,
never from the JSON. Every entry is checked whether or not the key was emitted (a missing key
leaves DeepSpeed's default); asked returns UNUSED where DeepSpeed reads nothing of the key in that
run. Sources, under deepspeed/runtime/: config.py (DeepSpeedConfig), zero/config.py and
zero/offload_config.py (pydantic: stage3_* are aliases of the field names), precision_config.py,
activation_checkpointing/config.py, engine.py (how the engine uses them)."""

from __future__ import annotations

from pathlib import Path

import torch
from deepspeed.runtime.config import DtypeEnum
from deepspeed.runtime.fp16.loss_scaler import DELAYED_SHIFT, MIN_LOSS_SCALE, SCALE_WINDOW

from toolkit.plan.backends import DEEPSPEED

UNUSED = object()  # the configuration asks nothing of this key: DeepSpeed does not use it in this run


# ---------------------------------------------------------------- what DeepSpeed holds
def _model_dtype(ds) -> torch.dtype:
    """engine.py get_data_types: fp16 if enabled, else bf16 if enabled, else fp32."""
    return (
        torch.float16 if ds.float16_config.enabled else torch.bfloat16 if ds.bfloat16_config.enabled else torch.float32
    )


def _reduce_dtype(ds) -> torch.dtype:
    """engine.py communication_data_type: the configured one (a torch dtype), else the model's."""
    return ds.communication_data_type or _model_dtype(ds)


def _accum_dtype(ds) -> torch.dtype:
    """engine.py get_data_types: data_types.grad_accum_dtype (a string) as a torch dtype, else the model's."""
    return _model_dtype(ds) if ds.grad_accum_dtype is None else DtypeEnum(ds.grad_accum_dtype).value


def _held_loss_scale(ds):
    """engine.py dynamic_loss_scale(): a loss_scale of 0 means dynamic scaling."""
    scale = ds.float16_config.loss_scale
    return "dynamic" if scale == 0 else scale


def _held_adam(ds) -> str:
    """The Adam the engine builds (engine.py get_optimizer_configuration): torch_adam (popped, default
    False) is torch's; else DeepSpeedCPUAdam for an optimizer offloaded to cpu or nvme, else FusedAdam."""
    if (ds.optimizer_params or {}).get("torch_adam", False):
        return "torch AdamW"
    offload = ds.zero_config.offload_optimizer
    return "DeepSpeedCPUAdam" if offload and offload.device in ("cpu", "nvme") else "FusedAdam"


def _zero(field: str):
    return lambda ds: getattr(ds.zero_config, field)


def _offload(section: str, field: str):
    """zero_config.offload_optimizer / offload_param (None: no offload; the device a plain string)."""

    def held(ds):
        offload = getattr(ds.zero_config, section)
        return getattr(offload, field) if offload else "none" if field == "device" else None

    return held


def _param(name: str):
    return lambda ds: (ds.optimizer_params or {}).get(name)


# ---------------------------------------------------------------- what the configuration asks
def _dtype(c) -> torch.dtype:
    """The model's dtype in DeepSpeed: bf16 or fp16 as asked, else fp32 (fp8 is Transformer Engine's,
    megatron only: backends.DEEPSPEED.precisions; its deepspeed.json trains in fp32)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(c.precision.dtype, torch.float32)


def _grad_dtype(from_stage: int):
    """precision.grad_reduce_in_fp32, as megatron-core runs it: fp32 gradients (here from ZeRO stage
    `from_stage` on), else the model's dtype."""

    def ask(c, lay):
        return torch.float32 if c.precision.grad_reduce_in_fp32 and c.zero.stage >= from_stage else _dtype(c)

    return ask


def _loss_scale(c, lay):
    """fp16 loss scaling: dynamic, or the static precision.loss_scale (loss_scaling=none: refused with fp16)."""
    if c.precision.dtype != "fp16":
        return UNUSED
    return "dynamic" if c.precision.loss_scaling == "dynamic" else c.precision.loss_scale


def _dynamic(field: str):
    """precision.<field>, read by dynamic fp16 loss scaling only (engine.py dynamic_loss_scale_args)."""

    def ask(c, lay):
        dynamic = c.precision.dtype == "fp16" and c.precision.loss_scaling == "dynamic"
        return getattr(c.precision, field) if dynamic else UNUSED

    return ask


def _at(stages: tuple[int, ...], asked):
    """asked at these ZeRO stages; DeepSpeed reads no ZeRO setting of a stage it does not run."""
    return lambda c, lay: asked(c, lay) if c.zero.stage in stages else UNUSED


def _offload_asked(section: str, field: str):
    """zero.<section> (offload_optimizer, offload_param): its device; pinned host memory on CUDA (none
    without it); the nvme_path for nvme."""

    def ask(c, lay):
        device = str(getattr(c.zero, section))
        if field == "device":
            return device
        if field == "pin_memory":
            return c.cluster.device == "cuda" if device != "none" else UNUSED
        return Path(c.zero.nvme_path) if device == "nvme" else UNUSED

    return ask


def _adam(c, lay) -> str:
    """torch's AdamW (no nvcc JIT build of FusedAdam), but DeepSpeed's vectorised CPU Adam for an
    optimizer offloaded on a GPU cluster (toolkit.emit.deepspeed._adam_kernel says why)."""
    return "DeepSpeedCPUAdam" if c.cluster.device == "cuda" and c.zero.offload_optimizer != "none" else "torch AdamW"


def _piped(asked):
    """asked with a pipeline: the deepspeed backend's PipelineEngine (pp > 1) reads ds_config.pipeline."""
    return lambda c, lay: asked(c, lay) if lay.pp > 1 else UNUSED


def _same(value):
    return lambda c, lay: value


ZERO, ZERO_1_2, ZERO_3 = (1, 2, 3), (1, 2), (3,)

# path -> (what DeepSpeed holds, what the configuration asks)
TABLE = {
    # batch: DeepSpeed checks train = micro x accum x dp (config.py _batch_assertion)
    "train_batch_size": (lambda ds: ds.train_batch_size, lambda c, lay: lay.global_batch),
    "train_micro_batch_size_per_gpu": (lambda ds: ds.train_micro_batch_size_per_gpu, lambda c, lay: lay.micro_batch),
    "gradient_accumulation_steps": (lambda ds: ds.gradient_accumulation_steps, lambda c, lay: lay.grad_accum),
    "gradient_clipping": (lambda ds: ds.gradient_clipping, lambda c, lay: c.optim.clip_grad),  # 0: none, in both
    "steps_per_print": (lambda ds: ds.steps_per_print, lambda c, lay: c.train.log_interval),
    "wall_clock_breakdown": (lambda ds: ds.wall_clock_breakdown, _same(False)),  # parakit times its own steps
    # ZeRO (zero/config.py DeepSpeedZeroConfig: the stage3_* keys are aliases of these fields)
    "zero_optimization.stage": (lambda ds: int(ds.zero_config.stage), lambda c, lay: c.zero.stage),
    "zero_optimization.reduce_scatter": (_zero("reduce_scatter"), _at(ZERO, _same(True))),
    "zero_optimization.reduce_bucket_size": (
        _zero("reduce_bucket_size"),
        _at(ZERO, lambda c, lay: c.zero.reduce_bucket_size),
    ),
    # ZeRO-1 reduces once after the last backward, ZeRO-2/3 every micro-batch, overlapped (backends.
    # GradReduce.ZERO_STAGED), and ZeRO-1 has no contiguous gradients: the planner's memory model (plan/memory.py)
    "zero_optimization.overlap_comm": (
        _zero("overlap_comm"),
        _at(ZERO, lambda c, lay: c.zero.overlap_comm and c.zero.stage >= 2),
    ),
    "zero_optimization.contiguous_gradients": (
        _zero("contiguous_gradients"),
        _at(ZERO, lambda c, lay: c.zero.stage >= 2),
    ),
    "zero_optimization.allgather_partitions": (_zero("allgather_partitions"), _at(ZERO_1_2, _same(True))),
    "zero_optimization.allgather_bucket_size": (
        _zero("allgather_bucket_size"),
        _at(ZERO_1_2, lambda c, lay: c.zero.allgather_bucket_size),
    ),
    "zero_optimization.stage3_prefetch_bucket_size": (
        _zero("prefetch_bucket_size"),
        _at(ZERO_3, lambda c, lay: c.zero.stage3_prefetch_bucket_size),
    ),
    "zero_optimization.stage3_param_persistence_threshold": (
        _zero("param_persistence_threshold"),
        _at(ZERO_3, lambda c, lay: c.zero.stage3_param_persistence_threshold),
    ),
    "zero_optimization.stage3_max_live_parameters": (
        _zero("max_live_parameters"),
        _at(ZERO_3, lambda c, lay: c.zero.stage3_max_live_parameters),
    ),
    "zero_optimization.stage3_max_reuse_distance": (_zero("max_reuse_distance"), _at(ZERO_3, _same(10**9))),
    # save_16bit_model writes a consolidated 16-bit model, as Hugging Face exports expect
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        _zero("gather_16bit_weights_on_model_save"),
        _at(ZERO_3, _same(True)),
    ),
    # ZeRO++: the validator allows it at ZeRO-3 only (rules/comm.py), so it is asked at every stage
    "zero_optimization.zero_hpz_partition_size": (
        _zero("zero_hpz_partition_size"),
        lambda c, lay: c.comm.hpz_partition_size,
    ),
    "zero_optimization.zero_quantized_weights": (
        _zero("zero_quantized_weights"),
        lambda c, lay: c.comm.quantized_weights,
    ),
    "zero_optimization.zero_quantized_gradients": (
        _zero("zero_quantized_gradients"),
        lambda c, lay: c.comm.quantized_gradients,
    ),
    # offload (zero/offload_config.py)
    **{
        f"zero_optimization.{section}.{field}": (_offload(section, field), _offload_asked(section, field))
        for section in ("offload_optimizer", "offload_param")
        for field in ("device", "pin_memory", "nvme_path")
    },
    # precision (precision_config.py)
    "bf16.enabled": (lambda ds: ds.bfloat16_config.enabled, lambda c, lay: c.precision.dtype == "bf16"),
    "fp16.enabled": (lambda ds: ds.float16_config.enabled, lambda c, lay: c.precision.dtype == "fp16"),
    "fp16.loss_scale": (_held_loss_scale, _loss_scale),
    "fp16.initial_scale_power": (lambda ds: ds.float16_config.initial_scale_power, _dynamic("initial_scale_power")),
    "fp16.loss_scale_window": (
        lambda ds: ds.float16_config.dynamic_loss_scale_args()[SCALE_WINDOW],
        _dynamic("loss_scale_window"),
    ),
    "fp16.hysteresis": (lambda ds: ds.float16_config.dynamic_loss_scale_args()[DELAYED_SHIFT], _dynamic("hysteresis")),
    "fp16.min_loss_scale": (
        lambda ds: ds.float16_config.dynamic_loss_scale_args()[MIN_LOSS_SCALE],
        _dynamic("min_loss_scale"),
    ),
    # gradients reduced in fp32 at every stage, accumulated in fp32 from the stage at which a ZeRO optimizer
    # keeps them (backends.DEEPSPEED.fp32_grads_from_stage; ZeRO-0 accumulates in the model's dtype:
    # DeepSpeed raises on any other, engine.py _do_optimizer_sanity_check "unsupported mix")
    "communication_data_type": (_reduce_dtype, _grad_dtype(0)),
    "data_types.grad_accum_dtype": (_accum_dtype, _grad_dtype(DEEPSPEED.fp32_grads_from_stage)),
    # optimizer (config.py get_optimizer_name lower-cases the type; the params are AdamW's keywords)
    "optimizer.type": (lambda ds: ds.optimizer_name, lambda c, lay: str(c.optim.name)),
    "optimizer.params.lr": (_param("lr"), lambda c, lay: lay.lr),  # after optim.lr_scaling
    "optimizer.params.betas": (
        lambda ds: list(_param("betas")(ds) or []),
        lambda c, lay: [c.optim.beta1, c.optim.beta2],
    ),
    "optimizer.params.eps": (_param("eps"), lambda c, lay: c.optim.eps),
    "optimizer.params.weight_decay": (_param("weight_decay"), lambda c, lay: c.optim.weight_decay),
    "optimizer.params.torch_adam": (_held_adam, _adam),
    # a keyword of torch.optim.AdamW: True runs its fused CUDA kernel; absent (None) lets torch choose
    "optimizer.params.fused": (
        _param("fused"),
        lambda c, lay: True if _adam(c, lay) == "torch AdamW" and c.cluster.device == "cuda" else None,
    ),
    # DeepSpeed's own checkpointing options (deepspeed.checkpointing): all off, its defaults; the layers are
    # recomputed by transformers' gradient checkpointing or the pipeline's checkpoint function
    **{
        f"activation_checkpointing.{field}": (
            lambda ds, field=field: getattr(ds.activation_checkpointing_config, field),
            _same(value),
        )
        for field, value in (
            ("partition_activations", False),
            ("contiguous_memory_optimization", False),
            ("cpu_checkpointing", False),
            ("number_checkpoints", None),
            ("synchronize_checkpoint_boundary", False),
            ("profile", False),
        )
    },
    # pipeline (config.py get_pipeline_config; pipe/engine.py reads activation_checkpoint_interval)
    "pipeline.stages": (lambda ds: ds.pipeline["stages"], _piped(lambda c, lay: lay.pp)),
    # the decoder layers evenly over the stages (layout.stage_layers; uneven stages are megatron's), as
    # toolkit/train/deepspeed_pipe.py partitions its PipelineModule: "type:" weighs the layers of that class
    # only (pipe/module.py _partition_layers); "parameters" would weigh the embedding and the head too
    "pipeline.partition": (lambda ds: ds.pipeline["partition"], _piped(_same("type:DecoderPipe"))),
    "pipeline.activation_checkpoint_interval": (
        lambda ds: ds.pipeline["activation_checkpoint_interval"],
        _piped(lambda c, lay: c.recompute.num_layers if c.recompute.granularity == "full" else 0),
    ),
}


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    """The key paths of a JSON object's leaves (lists are leaves), dot-joined."""
    paths = []
    for key, value in tree.items():
        path = prefix + key
        paths += _leaves(value, path + ".") if isinstance(value, dict) else [path]
    return paths


def check_deepspeed_readback(cfg, layout, ds_json: dict, ds_config) -> None:
    """Fails on a key of `ds_json` that TABLE does not cover, and on every TABLE entry whose value
    DeepSpeed holds (`ds_config`, the DeepSpeedConfig built from `ds_json`) differs from the one the
    configuration asks for."""
    unchecked = [path for path in _leaves(ds_json) if path not in TABLE]
    assert not unchecked, f"deepspeed.json keys without a read-back check in tests/deepspeed_readback.py: {unchecked}"
    wrong = []
    for path, (held, asked) in TABLE.items():
        want = asked(cfg, layout)
        if want is not UNUSED and (got := held(ds_config)) != want:
            wrong.append(f"{path}: DeepSpeed holds {got!r}, the configuration asks for {want!r}")
    where = (
        f"{cfg.model.name} on {cfg.cluster.name}, backend={cfg.backend.name} zero={cfg.zero.stage} "
        f"precision={cfg.precision.dtype} recompute={cfg.recompute.granularity} {layout.dims}"
    )
    assert not wrong, f"DeepSpeed reads deepspeed.json otherwise than asked ({where}):\n  " + "\n  ".join(wrong)
