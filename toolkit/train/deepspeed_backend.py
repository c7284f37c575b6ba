"""The deepspeed backend: a transformers model under DeepSpeed ZeRO 0-3 (zero.Init for stage 3),
with optimizer/parameter offload and activation checkpointing; for pp > 1 DeepSpeed's
PipelineModule over the same transformers layers (toolkit.train.deepspeed_pipe). The engine runs
with exactly the JSON parakit emitted for the layout (toolkit.train.deepspeed_engine builds it).
"""

from __future__ import annotations

import torch

from toolkit.config.schema import Config, is_moe
from toolkit.emit.deepspeed import deepspeed_config
from toolkit.plan.backends import kernels_of
from toolkit.plan.layout import Layout
from toolkit.train import deepspeed_engine, router_losses
from toolkit.train.checkpoint import seed_host_rngs
from toolkit.train.data import build_datasets, eval_batches, micro_batches
from toolkit.train.loop import Gradients


class DataParallelSteps(deepspeed_engine.EngineSteps):
    """ZeRO data parallel: engine(...), engine.backward and engine.step per micro-batch (DeepSpeed
    updates at the accumulation boundary)."""

    def begin_at(self, step: int) -> None:
        self.data = build_datasets(self.cfg, self.layout)
        self.batches = micro_batches(self.data.train, self.layout, torch.distributed.get_rank(), start_step=step)

    def evaluate(self) -> float:
        engine, layout = self.engine, self.layout
        batches = eval_batches(self.data.valid, layout, torch.distributed.get_rank())
        total = torch.zeros((), dtype=torch.float32, device=engine.device)
        engine.eval()
        with torch.no_grad():
            for _ in range(self.cfg.train.eval_iters * layout.grad_accum):
                batch = {k: v.to(engine.device) for k, v in next(batches).items()}
                logits = engine(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits
                total += deepspeed_engine.token_loss(logits, batch["labels"], batch["loss_mask"]).float()
        engine.train()
        torch.distributed.all_reduce(total)
        return total.item() / (self.cfg.train.eval_iters * layout.grad_accum * layout.dp)

    def forward_backward(self, step: int, poison: bool, beat) -> Gradients:
        engine, layout, moe = self.engine, self.layout, self.cfg.model.moe
        poison = poison and torch.distributed.get_rank() == 0
        experts = is_moe(self.cfg.model)
        # the LM loss, then the routers' logged losses: reduced together, no host sync per micro-batch
        names = router_losses.logged_names(moe) if experts else []
        total = torch.zeros(1 + len(names), dtype=torch.float32, device=engine.device)  # NCCL: device tensors
        fused_loss = kernels_of(self.cfg).loss
        for _ in range(layout.grad_accum):
            batch = {k: v.to(engine.device) for k, v in next(self.batches).items()}
            with self.compute.timing():
                # Liger's fused loss takes the (already shifted) labels and returns the mean over the
                # tokens not ignored, never the logits; else the loss over the model's logits
                labels = deepspeed_engine.ignored_labels(batch["labels"], batch["loss_mask"]) if fused_loss else None
                out = engine(
                    input_ids=batch["tokens"],
                    position_ids=batch["position_ids"],
                    **({"output_router_logits": True} if experts else {}),
                    **({"shift_labels": labels} if fused_loss else {}),
                )
                if fused_loss:
                    loss = out.loss
                else:
                    loss = deepspeed_engine.token_loss(out.logits, batch["labels"], batch["loss_mask"])
                objective = loss
                if experts:  # the routers' losses, layer by layer as megatron-core adds them
                    routers = router_losses.router_losses(out.router_logits, moe, batch["tokens"].size(0))
                    objective = loss + routers.total
                    total[1:] += torch.stack([routers.logged[name] for name in names])
                if poison:  # train.fault.nan_at_step: NaN gradients follow, as after a numerical fault
                    objective = objective * float("nan")
                    loss = loss * float("nan")
                engine.backward(objective)
            engine.step()
            total[0] += loss.detach().float()
            beat(step)
        total /= layout.grad_accum * layout.dp
        torch.distributed.all_reduce(total)
        values = total.tolist()
        return Gradients(values[0], extra=dict(zip(names, values[1:])))


def setup(cfg: Config, layout: Layout) -> deepspeed_engine.EngineSteps:
    """The deepspeed backend, built for the layout (toolkit.train.loop drives it)."""
    deepspeed = deepspeed_engine.init_deepspeed()
    world = torch.distributed.get_world_size()
    if world != layout.world_size:
        raise RuntimeError(f"launched with {world} processes but the layout needs {layout.world_size}")
    seed_host_rngs(cfg.train.seed)
    ds_json = deepspeed_config(cfg, layout)
    if layout.pp > 1:
        from toolkit.train.deepspeed_pipe import PipelineSteps

        return PipelineSteps.build(cfg, layout, deepspeed, ds_json)
    model = deepspeed_engine.build_hf_model(cfg, ds_json, deepspeed)
    return DataParallelSteps(cfg, layout, deepspeed_engine.initialize_engine(deepspeed, model, cfg, layout, ds_json))
