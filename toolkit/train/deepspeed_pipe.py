"""Pipeline parallel on the deepspeed backend: DeepSpeed's PipelineModule over the layers of the
same transformers model (embedding, decoder layers, final norm, output head), trained with
PipelineEngine.train_batch (1F1B, ZeRO <= 1 as DeepSpeed requires).

Tensors travel between stages as tuples (hidden states, position ids); decoder layers are
balanced across stages by DeepSpeed's "type:" partitioning.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from toolkit.config.schema import Config
from toolkit.families import family_of
from toolkit.plan.layout import Layout
from toolkit.train import deepspeed_engine
from toolkit.train.data import build_datasets, eval_batches, micro_batches
from toolkit.train.loop import Gradients


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
    parts = family_of(family).pipeline_parts(model)
    return [
        EmbeddingPipe(parts.tokens, parts.positions),
        *[DecoderPipe(layer, parts.rotary) for layer in parts.layers],
        HeadPipe(parts.norm, parts.head),
    ]


def hf_parameter_name(m, index: int, key: str) -> str | None:
    """The transformers name of parameter `key` of layer `index` of pipeline_layers(model) (what
    a pipeline checkpoint's layer_XX-model_states.pt files hold); None for what every decoder
    layer shares that is no parameter of the model (the rotary module's buffers)."""
    family = family_of(m.family)
    if index in (0, m.num_layers + 1):
        first, last = family.pipeline_names()
        names = first if index == 0 else last
        if key not in names:
            raise ValueError(f"pipeline layer {index} holds {key}, which is no parameter of model {m.name}")
        return names[key]
    if key.startswith("rotary."):
        return None
    if not key.startswith("layer."):
        raise ValueError(f"pipeline layer {index} holds {key}, which is no parameter of model {m.name}")
    return family.layer_prefix(index - 1) + key.removeprefix("layer.")


class _PipeLoss:
    """The last stage's loss; `poison` makes it NaN (train.fault.nan_at_step)."""

    def __init__(self):
        self.poison = False

    def __call__(self, logits, labels):
        target, loss_mask = labels
        loss = deepspeed_engine.token_loss(logits, target, loss_mask)
        return loss * float("nan") if self.poison else loss


def _pipe_batches(batches):
    for batch in batches:
        yield (batch["tokens"], batch["position_ids"]), (batch["labels"], batch["loss_mask"])


def _time_passes(engine, compute) -> None:
    """The engine's forward and backward pass instructions, timed (this engine only: its schedule
    looks each instruction up in _INSTRUCTION_MAP); sends and receives are not compute."""
    from deepspeed.runtime.pipe import schedule

    def timed(execute):
        def run(self, **kwargs):
            with compute.timing():
                return execute(self, **kwargs)

        return run

    passes = (schedule.ForwardPass, schedule.BackwardPass)
    engine._INSTRUCTION_MAP = {
        kind: timed(execute) if kind in passes else execute for kind, execute in engine._INSTRUCTION_MAP.items()
    }


class PipelineSteps(deepspeed_engine.EngineSteps):
    """DeepSpeed's PipelineEngine: train_batch runs the step's micro-batches (1F1B) and the update."""

    @classmethod
    def build(cls, cfg: Config, layout: Layout, deepspeed, ds_json: dict) -> PipelineSteps:
        from deepspeed.pipe import PipelineModule

        model = deepspeed_engine.build_hf_model(cfg, ds_json, deepspeed)
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
        steps = cls(cfg, layout, deepspeed_engine.initialize_engine(deepspeed, pipe, cfg, layout, ds_json))
        steps.pipe_loss = pipe_loss
        _time_passes(steps.engine, steps.compute)
        return steps

    def begin_at(self, step: int) -> None:
        self.dp_rank = self.engine.grid.get_data_parallel_id()
        self.data = build_datasets(self.cfg, self.layout)
        self.batches = _pipe_batches(micro_batches(self.data.train, self.layout, self.dp_rank, start_step=step))

    def _replica_mean(self, loss: torch.Tensor) -> float:
        """The last stage's loss, averaged over data-parallel replicas, on every rank."""
        engine = self.engine
        total = loss.detach().float().reshape(1).to(engine.device)  # NCCL reduces device tensors
        if engine.is_last_stage():
            torch.distributed.all_reduce(total, group=engine.grid.get_data_parallel_group())
        total = total / self.layout.dp
        torch.distributed.broadcast(total, src=torch.distributed.get_world_size() - 1)  # the last stage's value
        return total.item()

    def forward_backward(self, step: int, poison: bool, beat) -> Gradients:
        self.pipe_loss.poison = poison
        loss = self.engine.train_batch(data_iter=self.batches)  # mean over micro-batches, on every stage
        beat(step)
        return Gradients(self._replica_mean(loss))

    def evaluate(self) -> float:
        batches = _pipe_batches(eval_batches(self.data.valid, self.layout, self.dp_rank))
        self.pipe_loss.poison = False
        losses = [self.engine.eval_batch(data_iter=batches) for _ in range(self.cfg.train.eval_iters)]
        return self._replica_mean(torch.stack([loss.float().reshape(()) for loss in losses]).mean())
