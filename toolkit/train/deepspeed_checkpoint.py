"""DeepSpeed engine checkpoints inside parakit's verified publishing (toolkit.train.checkpoint):
the engine writes model, optimizer (ZeRO partitions), LR scheduler and its client state into the
staging directory, each rank adds its random states, rank 0 publishes."""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.plan.layout import Layout
from toolkit.train import checkpoint as ckpt

TAG = "state"


def save(engine, root: Path, step: int, layout: Layout, keep_last: int, fault, verify: str = "sha256") -> float:
    state = {
        "step": step,
        "consumed_samples": step * layout.global_batch,
        "layout": {"pp": layout.pp, "dp": layout.dp, "world": layout.world_size},
    }

    def write(staging: Path) -> None:  # synchronous: the engine's writes are done when it returns
        engine.save_checkpoint(str(staging), tag=TAG, client_state={"step": step})

    return ckpt.save_collectively(root, step, keep_last, fault, write, state, ckpt.host_rng_state(), verify)


def load(engine, root: Path, layout: Layout, verify: str = "sha256") -> ckpt.Resume:
    directory, unusable = ckpt.find_collectively(root, verify)
    if directory is None:
        return ckpt.Resume(unusable=unusable)
    _, client = engine.load_checkpoint(str(directory), tag=TAG)
    rng = ckpt.saved_rng_state(directory, layout.world_size)
    if rng is not None:
        ckpt.set_host_rng_state(rng)
    if torch.distributed.get_rank() == 0:
        print(f"resumed from {directory} at step {client['step']}", flush=True)
    return ckpt.Resume(int(client["step"]), str(directory), unusable)
