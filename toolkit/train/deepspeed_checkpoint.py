"""DeepSpeed engine checkpoints inside parakit's verified publishing (toolkit.train.checkpoint):
the engine writes model, optimizer (ZeRO partitions), LR scheduler and its client state into the
staging directory, each rank adds its random states, rank 0 publishes."""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

from toolkit.plan.layout import Layout
from toolkit.train import checkpoint as ckpt
from toolkit.train.faults import _exit as faults_exit
from toolkit.train.faults import corrupt, first_attempt

TAG = "state"


def host_rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_host_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(engine, root: Path, step: int, layout: Layout, keep_last: int, fault) -> Path | None:
    rank = torch.distributed.get_rank()
    if rank == 0:
        (ckpt.prepare(root, step) / "rng").mkdir()
    torch.distributed.barrier()
    staging = ckpt.partial_dir(root, step)
    engine.save_checkpoint(str(staging), tag=TAG, client_state={"step": step})
    torch.save(host_rng_state(), staging / "rng" / f"rank_{rank:05d}.pt")
    torch.distributed.barrier()
    published = None
    if rank == 0:
        if fault.crash_in_save_at_step == step and first_attempt():
            print(f"fault injection: rank 0 dies while saving step {step}", file=sys.stderr, flush=True)
            faults_exit(1)
        (staging / "trainer_state.json").write_text(json.dumps({
            "step": step, "consumed_samples": step * layout.global_batch, "layout": {"pp": layout.pp, "dp": layout.dp,
                                                                                      "world": layout.world_size}}))
        published = ckpt.publish(root, step, keep_last)
        print(f"saved checkpoint {published}", flush=True)
        if fault.corrupt_checkpoint_at_step == step and first_attempt():
            corrupt(published)
    torch.distributed.barrier()
    return published


def load(engine, root: Path, layout: Layout) -> int:
    found = [ckpt.find_resumable(root, report=lambda m: print(m, file=sys.stderr, flush=True))
             if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(found, src=0)
    if found[0] is None:
        return 0
    directory = Path(found[0])
    _, client = engine.load_checkpoint(str(directory), tag=TAG)
    state = json.loads((directory / "trainer_state.json").read_text())
    rng = directory / "rng" / f"rank_{torch.distributed.get_rank():05d}.pt"
    if state["layout"]["world"] == layout.world_size and rng.exists():
        set_host_rng_state(torch.load(rng, weights_only=False))
    if torch.distributed.get_rank() == 0:
        print(f"resumed from {directory} at step {client['step']}", flush=True)
    return int(client["step"])
