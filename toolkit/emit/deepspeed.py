"""The DeepSpeed JSON for a validated configuration.

Keys and their meaning: https://www.deepspeed.ai/docs/config-json/ (DeepSpeed 0.19). Batch
fields come from the resolved layout, so DeepSpeed's identity
train_batch_size = micro * gradient_accumulation_steps * dp holds by construction.

No "scheduler" section: none of DeepSpeed's schedulers can express the schedule megatron-core
runs for the same config (toolkit.plan.lr_schedule says why), so the trainer hands DeepSpeed that
schedule as a client scheduler (deepspeed.initialize(lr_scheduler=...)).
"""

from __future__ import annotations

from toolkit.config.schema import Config
from toolkit.plan.layout import Layout


def _zero_section(cfg: Config) -> dict:
    z = cfg.zero
    section: dict = {"stage": z.stage}
    if z.stage == 0:
        return section
    pin = cfg.cluster.device == "cuda"  # pinned host memory needs CUDA
    section.update(
        reduce_scatter=True,
        reduce_bucket_size=z.reduce_bucket_size,
        overlap_comm=z.overlap_comm and z.stage >= 2,
        contiguous_gradients=z.stage >= 2,
    )
    if z.stage in (1, 2):
        section.update(allgather_partitions=True, allgather_bucket_size=z.allgather_bucket_size)
    if z.stage == 3:
        section.update(
            stage3_prefetch_bucket_size=z.stage3_prefetch_bucket_size,
            stage3_param_persistence_threshold=z.stage3_param_persistence_threshold,
            stage3_max_live_parameters=z.stage3_max_live_parameters,
            stage3_max_reuse_distance=1_000_000_000,  # DeepSpeed default
            # Save a consolidated 16-bit model with save_16bit_model, as HF exports expect.
            stage3_gather_16bit_weights_on_model_save=True,
            # ZeRO++ (runtime/zero/config.py): hpZ, qwZ, qgZ
            zero_hpz_partition_size=cfg.comm.hpz_partition_size,
            zero_quantized_weights=cfg.comm.quantized_weights,
            zero_quantized_gradients=cfg.comm.quantized_gradients,
        )
    for key, device in (("offload_optimizer", z.offload_optimizer), ("offload_param", z.offload_param)):
        if device != "none":
            section[key] = {"device": device, "pin_memory": pin}
            if device == "nvme":
                section[key]["nvme_path"] = z.nvme_path
    return section


def _gradient_dtypes(cfg: Config) -> dict:
    """precision.grad_reduce_in_fp32 as megatron-core runs it (fp32 main gradients, reduced in fp32),
    in DeepSpeed's terms: `communication_data_type` for the reductions, and `data_types.grad_accum_dtype`
    for the accumulation over micro-batches where a ZeRO optimizer keeps it (stages 1-3; ZeRO-1 in bf16
    becomes DeepSpeed's BF16_Optimizer). Without them DeepSpeed reduces and accumulates in bf16/fp16.
    ZeRO-0 accumulates in the model's dtype: DeepSpeed raises for any other (engine.py
    _do_optimizer_sanity_check, "unsupported mix")."""
    pr = cfg.precision
    if pr.dtype == "fp32" or not pr.grad_reduce_in_fp32:
        return {}
    section: dict = {"communication_data_type": "fp32"}
    if cfg.zero.stage >= 1:
        section["data_types"] = {"grad_accum_dtype": "fp32"}
    return section


def _precision_section(cfg: Config) -> dict:
    pr = cfg.precision
    if pr.dtype == "bf16":
        return {"bf16": {"enabled": True}, **_gradient_dtypes(cfg)}
    if pr.dtype == "fp16":
        # DeepSpeed: loss_scale 0 means dynamic scaling starting at 2**initial_scale_power.
        return {
            "fp16": {
                "enabled": True,
                "loss_scale": 0 if pr.loss_scaling == "dynamic" else pr.loss_scale,
                "initial_scale_power": pr.initial_scale_power,
                "loss_scale_window": pr.loss_scale_window,
                "hysteresis": pr.hysteresis,
                "min_loss_scale": pr.min_loss_scale,
            },
            **_gradient_dtypes(cfg),
        }
    return {}


def _adam_kernel(cfg: Config) -> dict:
    """Which Adam DeepSpeed steps. Its FusedAdam is JIT-compiled at the first run (nvcc and ninja:
    minutes, or a failure where the CUDA toolkit does not match torch's); torch's AdamW runs the same
    update with no build, on GPUs as its fused multi-tensor CUDA kernel. An optimizer offloaded to
    the host keeps DeepSpeed's CPU Adam on GPU clusters (vectorised C++, built with the host compiler;
    torch's is several times slower there); on a CPU cluster everything is torch's (no compiler)."""
    if cfg.cluster.device == "cpu":
        return {"torch_adam": True}
    if cfg.zero.offload_optimizer != "none":
        return {"torch_adam": False}
    return {"torch_adam": True, "fused": True}


def deepspeed_config(cfg: Config, layout: Layout) -> dict:
    """The DeepSpeed JSON (as a dict) for a validated configuration and its resolved layout: batch
    split, ZeRO stage and offload, precision and loss scaling, optimizer, gradient clipping,
    activation checkpointing; the learning-rate schedule is the trainer's (toolkit.plan.lr_schedule)."""
    o = cfg.optim
    ds: dict = {
        "train_batch_size": layout.global_batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.grad_accum,
        "gradient_clipping": o.clip_grad,
        "steps_per_print": cfg.train.log_interval,
        "wall_clock_breakdown": False,
        "zero_optimization": _zero_section(cfg),
        **_precision_section(cfg),
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": layout.lr,
                "betas": [o.beta1, o.beta2],
                "eps": o.eps,
                "weight_decay": o.weight_decay,
                **_adam_kernel(cfg),
            },
        },
    }
    if cfg.recompute.granularity == "full":
        ds["activation_checkpointing"] = {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
            "number_checkpoints": None,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    if layout.pp > 1:
        ds["pipeline"] = {
            "stages": layout.pp,
            # The decoder layers evenly over the stages (layout.stage_layers), as toolkit.train.deepspeed_pipe
            # partitions its PipelineModule: "type:" weighs only the layers of that class, "parameters" would
            # weigh the embedding and head too (DeepSpeed runtime/pipe/module.py _partition_layers).
            "partition": "type:DecoderPipe",
            "activation_checkpoint_interval": cfg.recompute.num_layers if cfg.recompute.granularity == "full" else 0,
        }
    return ds
