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
        )
    for key, device in (("offload_optimizer", z.offload_optimizer), ("offload_param", z.offload_param)):
        if device != "none":
            section[key] = {"device": device, "pin_memory": pin}
            if device == "nvme":
                section[key]["nvme_path"] = z.nvme_path
    return section


def _precision_section(cfg: Config) -> dict:
    pr = cfg.precision
    if pr.dtype == "bf16":
        return {"bf16": {"enabled": True}}
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
            }
        }
    return {}


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
                # FusedAdam is a CUDA kernel; on CPU use torch.optim.AdamW (no JIT compile).
                "torch_adam": cfg.cluster.device == "cpu",
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
            "partition": "parameters",
            "activation_checkpoint_interval": cfg.recompute.num_layers if cfg.recompute.granularity == "full" else 0,
        }
    return ds
