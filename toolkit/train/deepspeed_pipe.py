"""Pipeline parallel on the deepspeed backend: DeepSpeed's PipelineModule over the layers of the
same transformers model (embedding, decoder layers, final norm, output head), trained with
PipelineEngine.train_batch (1F1B, ZeRO <= 1 as DeepSpeed requires).

Tensors travel between stages as tuples (hidden states, position ids); decoder layers are
balanced across stages by DeepSpeed's "type:" partitioning.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from torch import nn

from toolkit.config.schema import Config
from toolkit.plan.layout import Layout
from toolkit.train.data import micro_batches, train_dataset
from toolkit.train.distributed import end_process_group
from toolkit.train.metrics import Metrics


class EmbeddingPipe(nn.Module):
    def __init__(self, tokens: nn.Module, positions: nn.Module | None = None):
        super().__init__()
        self.tokens, self.positions = tokens, positions

    def forward(self, inputs):
        input_ids, position_ids = inputs
        hidden = self.tokens(input_ids)
        if self.positions is not None:  # GPT-2's learned positions
            hidden = hidden + self.positions(position_ids)
        return hidden, position_ids


class DecoderPipe(nn.Module):
    def __init__(self, layer: nn.Module, rotary: nn.Module | None = None):
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, inputs):
        hidden, position_ids = inputs
        if self.rotary is not None:  # Llama-style: RoPE cos/sin for these positions
            out = self.layer(hidden, position_ids=position_ids, position_embeddings=self.rotary(hidden, position_ids))
        else:
            out = self.layer(hidden)
        return (out[0] if isinstance(out, tuple) else out), position_ids


class HeadPipe(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Module):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, inputs):
        hidden, _ = inputs
        return self.head(self.norm(hidden))


def pipeline_layers(model, family: str) -> list[nn.Module]:
    """The transformers model, cut into the sequence a PipelineModule partitions."""
    if family == "gpt2":
        body = model.transformer
        return [
            EmbeddingPipe(body.wte, body.wpe),
            *[DecoderPipe(block) for block in body.h],
            HeadPipe(body.ln_f, model.lm_head),
        ]
    body = model.model
    return [
        EmbeddingPipe(body.embed_tokens),
        *[DecoderPipe(layer, body.rotary_emb) for layer in body.layers],
        HeadPipe(body.norm, model.lm_head),
    ]


class _PipeLoss:
    """The last stage's loss; `poison` makes it NaN (train.fault.nan_at_step)."""

    def __init__(self):
        self.poison = False

    def __call__(self, logits, labels):
        from toolkit.train.deepspeed_backend import token_loss

        target, loss_mask = labels
        loss = token_loss(logits, target, loss_mask)
        return loss * float("nan") if self.poison else loss


def _pipe_batches(batches):
    for batch in batches:
        yield (batch["tokens"], batch["position_ids"]), (batch["labels"], batch["loss_mask"])


def train_pipeline(cfg: Config, layout: Layout, run_dir: Path, deepspeed, ds_json: dict) -> list[float]:
    from deepspeed.pipe import PipelineModule

    from toolkit.train.deepspeed_backend import build_hf_model

    model = build_hf_model(cfg, ds_json, deepspeed)
    checkpoint = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    pipe_loss = _PipeLoss()
    pipe = PipelineModule(
        layers=pipeline_layers(model, cfg.model.family),
        num_stages=layout.pp,
        loss_fn=pipe_loss,
        partition_method="type:DecoderPipe",
        activation_checkpoint_interval=cfg.recompute.num_layers if cfg.recompute.granularity == "full" else 0,
        activation_checkpoint_func=checkpoint,
    )
    del model
    from toolkit.train.deepspeed_backend import Checkpointing, initialize_engine

    engine = initialize_engine(deepspeed, pipe, cfg, layout, ds_json)
    from toolkit.train.faults import inject_step_faults

    run = Checkpointing(cfg, layout, run_dir, engine)
    dp_rank = engine.grid.get_data_parallel_id()
    batches = _pipe_batches(micro_batches(train_dataset(cfg, layout), layout, dp_rank, start_step=run.start))
    metrics = Metrics(cfg, layout, run_dir, enabled=torch.distributed.get_rank() == 0, resume=run.resume)
    for step in range(run.start + 1, layout.steps + 1):
        inject_step_faults(cfg.train.fault, step)
        pipe_loss.poison = run.nan_injected(step)
        loss = engine.train_batch(data_iter=batches)  # mean over micro-batches, on every stage
        run.watchdog.beat(step)
        total = loss.detach().float().cpu().reshape(1)
        if engine.is_last_stage():
            torch.distributed.all_reduce(total, group=engine.grid.get_data_parallel_group())
        total = total / layout.dp
        torch.distributed.broadcast(total, src=torch.distributed.get_world_size() - 1)  # the last stage's value
        run.end_step(step, total.item(), metrics)
    losses = metrics.close(run_dir)
    end_process_group()
    return losses
