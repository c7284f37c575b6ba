"""The deepspeed backend: a transformers model under DeepSpeed ZeRO 0-3 (zero.Init for stage 3),
with optimizer/parameter offload, activation checkpointing and, for pp > 1, DeepSpeed's
PipelineModule over the same transformers layers (toolkit.train.deepspeed_pipe).

The engine runs with exactly the JSON parakit emitted for the layout. On CPU, DeepSpeed's
shared-memory collective (a C++ extension compiled at start-up) is skipped so that no compiler
is needed: gloo does every collective, with identical results.
"""

from __future__ import annotations

import importlib
import math
import os
import random
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from toolkit.config.schema import Config
from toolkit.emit.deepspeed import deepspeed_config
from toolkit.plan.layout import Layout
from toolkit.plan.lr_schedule import LRSchedule, lr_schedule
from toolkit.train.data import micro_batches, train_dataset
from toolkit.train.distributed import end_process_group
from toolkit.train.faults import first_attempt, inject_step_faults
from toolkit.train.metrics import Metrics


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


_ZERO3_CONFIG = None


def build_hf_model(cfg: Config, ds_json: dict, deepspeed):
    """The transformers model (fp32; DeepSpeed casts it): random init from conf/model, or the
    weights of model.hf_path. ZeRO-3 builds it under zero.Init so that no rank holds all parameters."""
    global _ZERO3_CONFIG
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from toolkit.interop.hf import check_hf_matches, hf_config

    config = hf_config(cfg.model)
    if cfg.model.hf_path:
        check_hf_matches(cfg.model, cfg.model.hf_path)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if cfg.zero.stage == 3:
        # transformers' DeepSpeed integration: with this object alive, from_config/from_pretrained
        # build the model under deepspeed.zero.Init and gather each module's partitioned
        # parameters while initialising or loading them (so the weights equal the unsharded ones).
        from transformers.integrations import HfDeepSpeedConfig

        _ZERO3_CONFIG = HfDeepSpeedConfig(ds_json)  # transformers holds only a weak reference
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
    if cfg.recompute.granularity == "full":
        # Non-reentrant checkpointing: the reentrant kind silently drops the gradients of a
        # block whose inputs do not require grad (the embedding output under ZeRO-3, say).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


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


class Checkpointing:
    """Resume, periodic verified saves, the watchdog and the NaN check around a DeepSpeed engine."""

    def __init__(self, cfg: Config, layout: Layout, run_dir: Path, engine):
        from toolkit.train import checkpoint as ckpt
        from toolkit.train import deepspeed_checkpoint
        from toolkit.train.faults import Watchdog
        from toolkit.train.save_schedule import SaveSchedule

        self.cfg, self.layout, self.engine, self.io = cfg, layout, engine, deepspeed_checkpoint
        self.root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
        self.run_dir = run_dir
        self.resume = self.io.load(engine, self.root, layout) if cfg.checkpoint.resume else ckpt.Resume()
        self.start = self.resume.step
        self.watchdog = Watchdog(cfg.train.fault.watchdog_timeout_s)
        self.schedule = SaveSchedule(cfg, layout)

    def nan_injected(self, step: int) -> bool:
        """train.fault.nan_at_step: a loss of this step becomes NaN before the backward pass, so
        that NaN gradients reach DeepSpeed as a numerical fault would."""
        return self.cfg.train.fault.nan_at_step == step and first_attempt()

    def poisoned(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if self.nan_injected(step) and torch.distributed.get_rank() == 0 else loss

    def skipped(self, step: int, loss: float, metrics) -> bool:
        """Whether the engine skipped this step's update. A non-finite loss stops the run (the last
        good checkpoint kept) or, with nan_action=skip, relies on DeepSpeed's overflow check, which
        drops the update when the gradients are not finite (fp16, bf16 and fp32 ZeRO 1-3)."""
        applied = self.engine.was_step_applied()
        if math.isfinite(loss):
            return not applied  # fp16 loss-scale overflow
        if self.cfg.train.fault.nan_action == "stop" or applied:
            metrics.close(self.run_dir, complete=False)
            why = (
                "DeepSpeed applied the update (no overflow check in this configuration)"
                if applied and self.cfg.train.fault.nan_action == "skip"
                else "train.fault.nan_action=skip skips such steps"
            )
            raise FloatingPointError(
                f"non-finite loss {loss} at step {step}; stopping with the last good checkpoint "
                f"in {self.root} kept ({why})"
            )
        return True

    def end_step(self, step: int, loss: float, metrics) -> None:
        """After the engine's step: the NaN check, the step's metrics, a save when one is due."""
        skipped = self.skipped(step, loss, metrics)
        grad_norm = None if skipped else self.engine.get_global_grad_norm()
        metrics.step(step, loss, self.engine.get_lr()[0], None if grad_norm is None else float(grad_norm), skipped)
        self.maybe_save(step, metrics)

    def maybe_save(self, step: int, metrics) -> None:
        if self.schedule.due(step):
            with self.watchdog.suspended():
                blocked = self.io.save(
                    self.engine, self.root, step, self.layout, self.cfg.checkpoint.keep_last, self.cfg.train.fault
                )
                self.schedule.saved(step, blocked, metrics.history[-1]["step_time_s"])


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: Config, layout: Layout, run_dir: Path) -> list[float]:
    deepspeed = init_deepspeed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if world != layout.world_size:
        raise RuntimeError(f"launched with {world} processes but the layout needs {layout.world_size}")
    _seed(cfg.train.seed)
    ds_json = deepspeed_config(cfg, layout)
    if layout.pp > 1:
        from toolkit.train.deepspeed_pipe import train_pipeline

        return train_pipeline(cfg, layout, run_dir, deepspeed, ds_json)
    model = build_hf_model(cfg, ds_json, deepspeed)
    engine = initialize_engine(deepspeed, model, cfg, layout, ds_json)
    run = Checkpointing(cfg, layout, run_dir, engine)
    batches = micro_batches(train_dataset(cfg, layout), layout, dp_rank=rank, start_step=run.start)
    device = engine.device
    metrics = Metrics(cfg, layout, run_dir, enabled=rank == 0, resume=run.resume)
    for step in range(run.start + 1, layout.steps + 1):
        inject_step_faults(cfg.train.fault, step)
        total = torch.zeros((), dtype=torch.float32)
        for _ in range(layout.grad_accum):
            batch = {k: v.to(device) for k, v in next(batches).items()}
            logits = engine(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits
            loss = run.poisoned(step, token_loss(logits, batch["labels"], batch["loss_mask"]))
            engine.backward(loss)
            engine.step()  # DeepSpeed updates only at the accumulation boundary
            total += loss.detach().float().cpu()
            run.watchdog.beat(step)
        total /= layout.grad_accum
        torch.distributed.all_reduce(total)
        run.end_step(step, total.item() / layout.dp, metrics)
    losses = metrics.close(run_dir)
    end_process_group()
    return losses
