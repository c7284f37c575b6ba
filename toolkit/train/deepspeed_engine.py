"""The DeepSpeed engine parakit trains: the transformers model (random init that depends only on
the seed, or Hugging Face weights), megatron-core's weight-decay groups, the run's learning-rate
schedule, deepspeed.initialize with the emitted JSON; and the steps every DeepSpeed layout shares
(update, learning rate, verified checkpoints), as toolkit.train.loop's BackendSteps.

On CPU, DeepSpeed's shared-memory collective (a C++ extension compiled at start-up) is skipped so
that no compiler is needed: gloo does every collective, with identical results.
"""

from __future__ import annotations

import importlib
import os
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from toolkit.config.schema import Config
from toolkit.plan.backends import Kernels, kernels_of
from toolkit.plan.layout import Layout
from toolkit.plan.lr_schedule import LRSchedule, lr_schedule
from toolkit.train import checkpoint as ckpt
from toolkit.train import deepspeed_checkpoint
from toolkit.train.checkpoint import Resume
from toolkit.train.console import prints_logged
from toolkit.train.distributed import end_process_group
from toolkit.train.loop import Update
from toolkit.train.probe import ComputeTimers


def init_deepspeed():
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # The attribute deepspeed.comm.torch is shadowed by the torch module: import by name.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    from toolkit.train.distributed import init_process_group

    init_process_group()  # deepspeed.comm adopts the existing group
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return deepspeed


def build_hf_model(cfg: Config, ds_json: dict, deepspeed):
    """The transformers model (fp32; DeepSpeed casts it): random init from conf/model, or the
    weights of model.hf_path. ZeRO-3 builds it under zero.Init so that no rank holds all parameters."""
    zero3_config = None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from toolkit.families.hf_config import check_matches, hf_config

    config = hf_config(cfg.model)
    if cfg.model.hf_path:
        check_matches(cfg.model, cfg.model.hf_path)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if cfg.zero.stage == 3:
        # transformers' DeepSpeed integration: with this object alive, from_config/from_pretrained
        # build the model under deepspeed.zero.Init and gather each module's partitioned
        # parameters while initialising or loading them (so the weights equal the unsharded ones).
        from transformers.integrations import HfDeepSpeedConfig

        zero3_config = HfDeepSpeedConfig(ds_json)
    if cfg.model.hf_path:
        model = model_class.from_pretrained(cfg.model.hf_path, dtype=torch.float32)
    else:
        model = model_class._from_config(config, dtype=torch.float32)
        seeded_init(
            model,
            cfg.model.init_method_std,
            cfg.model.num_layers,
            cfg.train.seed,
            deepspeed if cfg.zero.stage == 3 else None,
        )
    apply_fused_kernels(model, kernels_of(cfg))
    if cfg.recompute.granularity == "full":
        # Non-reentrant checkpointing: the reentrant kind silently drops the gradients of a
        # block whose inputs do not require grad (the embedding output under ZeRO-3, say).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    # transformers holds only a weak reference to the ZeRO-3 config: it lives as long as the model.
    model.parakit_zero3_config = zero3_config
    return model


def apply_fused_kernels(model, kernels: Kernels) -> None:
    """Liger's kernels in the transformers model where train.kernels resolved to fused ones: its
    RMSNorm, RoPE and SwiGLU in every layer, and the fused linear cross-entropy as the model's forward
    (liger_kernel.transformers.monkey_patch: the family's apply function, given the built model)."""
    if not (kernels.layers or kernels.loss):
        return
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    MODEL_TYPE_TO_APPLY_LIGER_FN[model.config.model_type](
        rope=kernels.layers,
        rms_norm=kernels.layers,
        swiglu=kernels.layers,
        cross_entropy=False,
        fused_linear_cross_entropy=kernels.loss,
        model=model,
    )


def ignored_labels(labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The labels with the masked tokens set to -100, the index cross-entropy losses ignore (what a
    loss given labels instead of logits takes for train.loss_mask's zeros)."""
    return labels.masked_fill(loss_mask == 0, -100)


_OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "attn.c_proj", "mlp.c_proj")


def seeded_init(model, std: float, num_layers: int, seed: int, deepspeed=None) -> None:
    """Initial weights that depend only on the seed and each parameter's name, never on how the
    model was built (ZeRO-3's zero.Init consumes the RNG differently): norms 1, biases 0,
    matrices N(0, std), output projections N(0, std / sqrt(2 L)) (Megatron-LM's scaled init,
    Shoeybi et al. 2019). Under ZeRO-3 each parameter is gathered, set on rank 0, re-partitioned."""
    import zlib

    for name, param in model.named_parameters():
        gather = deepspeed.zero.GatheredParameters([param], modifier_rank=0) if deepspeed else _NoGather()
        with gather, torch.no_grad():
            if deepspeed and torch.distributed.get_rank() != 0:
                continue
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:  # norm weights
                param.fill_(1.0)
            else:
                scale = std / (2 * num_layers) ** 0.5 if any(p in name for p in _OUTPUT_PROJECTIONS) else std
                generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                param.copy_(torch.randn(param.shape, generator=generator) * scale)


class _NoGather:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class ScheduledLR(torch.optim.lr_scheduler.LRScheduler):
    """The run's learning-rate schedule (toolkit.plan.lr_schedule, megatron-core's) as the client
    scheduler DeepSpeed steps after every applied update; the first value is set here, before the
    first update, as megatron-core's scheduler does."""

    def __init__(self, optimizer, schedule: LRSchedule):
        self.schedule = schedule
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [self.schedule.lr(self.last_epoch) for _ in self.optimizer.param_groups]


def optimizer_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters in megatron-core's weight-decay groups: none on biases and 1-D
    parameters (norms), `weight_decay` on the rest (get_standard_config_overrides). Under ZeRO-3
    a parameter's own shape is its partition's: ds_shape is the real one."""
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if param.requires_grad:
            one_dim = len(getattr(param, "ds_shape", param.shape)) == 1
            (no_decay if one_dim or name.endswith(".bias") else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def initialize_engine(deepspeed, module: torch.nn.Module, cfg: Config, layout: Layout, ds_json: dict):
    """deepspeed.initialize with the emitted JSON, megatron-core's weight-decay groups and the run's
    learning-rate schedule."""
    from toolkit.train.eager_imports import import_without_compiling

    import_without_compiling("deepspeed.runtime.zero.muon.muon_optimizer")  # its ZeRO optimizer check imports it
    with prints_logged("deepspeed"):  # its memory report per optimizer group: the log files, not the console
        engine, _, _, _ = deepspeed.initialize(
            model=module,
            model_parameters=optimizer_groups(module, cfg.optim.weight_decay),
            config=ds_json,
            lr_scheduler=partial(ScheduledLR, schedule=lr_schedule(cfg, layout)),
        )
    return engine


def token_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the masked tokens; labels are already the next tokens (the same
    loss megatron-core's GPTModel computes, no shift)."""
    losses = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="none")
    mask = loss_mask.reshape(-1).float()
    return torch.sum(losses * mask) / mask.sum()


class EngineSteps:
    """What every DeepSpeed layout does the same way around its forward/backward: the update
    (inside engine.step at the accumulation boundary), the learning rate, checkpoints."""

    def __init__(self, cfg: Config, layout: Layout, engine):
        self.cfg, self.layout, self.engine = cfg, layout, engine
        self.compute = ComputeTimers()

    def load(self, root: Path) -> Resume:
        return deepspeed_checkpoint.load(self.engine, root, self.layout, self.cfg.checkpoint.verify)

    def update(self) -> Update:
        applied = self.engine.was_step_applied()  # False after an fp16 loss-scale overflow
        grad_norm = self.engine.get_global_grad_norm() if applied else None
        return Update(applied, None if grad_norm is None else float(grad_norm))

    def update_applied_anyway(self) -> bool:
        # DeepSpeed's overflow check (fp16, bf16 and fp32 ZeRO 1-3) drops an update with
        # non-finite gradients; its plain fp32 optimizer applies it.
        return self.engine.was_step_applied()

    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def kernels(self) -> dict:
        """The attention transformers runs, the Adam DeepSpeed steps (FusedAdam, or torch's) and the
        layers' and loss's kernels (train.kernels)."""
        from toolkit.train.capabilities import qualified_name

        attention = next(
            (m.config._attn_implementation for m in self.engine.module.modules() if hasattr(m, "config")), None
        )
        return {
            "attention": f"transformers {attention}",
            "adam": qualified_name(type(self.engine.basic_optimizer)),
            **kernels_of(self.cfg).names,  # build_hf_model applied these or raised
        }

    def save(self, root: Path, step: int, resumed_from: str | None = None) -> float:
        c = self.cfg.checkpoint
        fault = self.cfg.train.fault
        saved_by = ckpt.model_record(self.cfg)
        return deepspeed_checkpoint.save(
            self.engine, root, step, self.layout, c.keep_last, fault, c.verify, saved_by, resumed_from
        )

    def settle_saves(self, blocking: bool) -> None:
        pass  # DeepSpeed's save is synchronous

    def close(self) -> None:
        end_process_group()
