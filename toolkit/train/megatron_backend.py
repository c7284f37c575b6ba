"""The megatron backend: megatron-core GPTModel + DDP (+ distributed optimizer), trained with
get_forward_backward_func (1F1B, interleaved 1F1B when vpp > 1) from the resolved layout.

Runs on NVIDIA GPUs with NCCL, and on CPU with gloo through toolkit.train.mcore_cpu.
"""
from __future__ import annotations

import os
import random
from functools import partial
from pathlib import Path

import numpy as np
import torch

from toolkit.config.schema import Config
from toolkit.emit.megatron import build_megatron_configs, megatron_sections
from toolkit.plan.layout import Layout
from toolkit.train import mcore_cpu
from toolkit.train.data import micro_batches, train_dataset
from toolkit.train.metrics import Metrics


def _init_distributed(layout: Layout) -> None:
    if not torch.distributed.is_initialized():
        if "RANK" not in os.environ:  # a single process outside torchrun
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", str(29400 + os.getpid() % 1000)))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = torch.distributed.get_world_size()
    if world != layout.world_size:
        raise RuntimeError(f"launched with {world} processes but the layout needs {layout.world_size} "
                           "(cluster.nodes x cluster.gpus_per_node)")


def _seed(seed: int) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _loss(loss_mask: torch.Tensor, output: torch.Tensor):
    """Mean token loss of one micro-batch (the schedule divides by the number of micro-batches)."""
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(output.float().reshape(-1) * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}  # the schedule scales `loss` in place


def _forward_step(data_iterator, model):
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:  # a middle pipeline stage: activations come from the previous stage
        return model(None, None, None), partial(_loss, None)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss, batch["loss_mask"])


def _load_weights(chunks: list, path: str) -> None:
    """Load model weights saved at any layout (dist_checkpointing reshards). All chunks in one
    call: their sharded tensors together cover every layer, which the loader validates."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({f"chunk{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}, path)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"chunk{i}"], strict=True)


def _save_weights(chunks: list, path: str) -> None:
    """Save model weights layout-free: sharded tensors carry global layer keys and offsets."""
    from megatron.core import dist_checkpointing

    Path(path).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save({f"chunk{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}, path)


def train(cfg: Config, layout: Layout, run_dir: Path) -> list[float]:
    mcore_cpu.enable()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    from toolkit.train.megatron_model import build_model_chunks

    _init_distributed(layout)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None, context_parallel_size=layout.cp)
    _seed(cfg.train.seed)
    sections = megatron_sections(cfg, layout)
    transformer_config, optimizer_config, ddp_config = build_megatron_configs(sections)
    chunks = build_model_chunks(sections, transformer_config)
    if cfg.train.init_checkpoint:
        _load_weights(chunks, cfg.train.init_checkpoint)
    if cfg.train.save_init_checkpoint:
        _save_weights(chunks, cfg.train.save_init_checkpoint)
    if transformer_config.bf16 or transformer_config.fp16:
        chunks = [Float16Module(transformer_config, chunk) for chunk in chunks]
    model = [DistributedDataParallel(transformer_config, ddp_config, chunk, disable_bucketing=i > 0)
             for i, chunk in enumerate(chunks)]
    transformer_config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    transformer_config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(optimizer_config, model)
    if transformer_config.fp16:
        transformer_config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(optimizer, **sections["scheduler"])

    dataset = train_dataset(cfg, layout)
    dp_rank = parallel_state.get_data_parallel_rank()
    needs_data = parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
    iterators = [micro_batches(dataset, layout, dp_rank) if needs_data else None for _ in model]
    last_stage_reporter = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    metrics = Metrics(cfg, layout, run_dir, enabled=torch.distributed.get_rank() == 0)
    forward_backward = get_forward_backward_func()
    for step in range(1, layout.steps + 1):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        outputs = forward_backward(
            forward_step_func=_forward_step, data_iterator=iterators if len(model) > 1 else iterators[0],
            model=model if len(model) > 1 else model[0], num_microbatches=layout.grad_accum,
            seq_length=layout.seq_length, micro_batch_size=layout.micro_batch, forward_only=False)
        updated, grad_norm, _ = optimizer.step()
        if updated:
            scheduler.step(increment=1)
        # Mean loss over micro-batches and data-parallel replicas, gathered on every rank.
        local = torch.stack([o["lm loss"] for o in outputs]).mean() if last_stage_reporter and outputs else torch.zeros(())
        total = local.reshape(1).float().clone()
        torch.distributed.all_reduce(total)
        loss = total.item() / (layout.dp * layout.cp)
        metrics.step(step, loss, optimizer.param_groups[0]["lr"], None if grad_norm is None else float(grad_norm), not updated)
    metrics.close(run_dir)
    losses = [r["loss"] for r in metrics.history]
    parallel_state.destroy_model_parallel()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return losses
