"""Bytes of tensors a DeepSpeed engine holds per rank, for the planner comparison.

torchrun --nproc-per-node 2 tests/dist/ds_model_states.py OUT.json [hydra overrides...]

Builds the transformers model of the composed config, initialises DeepSpeed with the JSON parakit
emits, runs one optimizer step (so Adam states exist), then a forward and backward of the next
step, and counts every live tensor storage (gc) at that point: weights, gradients, optimizer
states and DeepSpeed's buffers, without activations (freed by backward).
"""
import importlib
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402
from live_tensors import live_tensor_bytes  # noqa: E402




def main():
    out, overrides = sys.argv[1], sys.argv[2:]
    # No C++ compiler needed: gloo does every collective (DeepSpeed's shm op is an optimisation).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed
    from transformers import AutoModelForCausalLM

    from toolkit.config.store import compose_config
    from toolkit.emit.deepspeed import deepspeed_config
    from toolkit.interop.hf import hf_config
    from toolkit.plan.validate import check

    cfg = compose_config(overrides)
    layout, _ = check(cfg)
    ds_json = deepspeed_config(cfg, layout)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    baseline = live_tensor_bytes()
    model = AutoModelForCausalLM.from_config(hf_config(cfg.model))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_json)
    del model
    g = torch.Generator().manual_seed(rank)

    def micro_step():
        tokens = torch.randint(0, cfg.model.vocab_size, (layout.micro_batch, cfg.model.seq_length), generator=g)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        return float(loss)

    for _ in range(layout.grad_accum):  # one whole optimizer step: Adam states now exist
        micro_step()
        engine.step()
    held = 0
    for _ in range(layout.grad_accum):  # the next step: gradients live after each backward
        micro_step()
        held = max(held, live_tensor_bytes() - baseline)
        engine.step()
    results = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(results, {"rank": rank, "bytes": held})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"ranks": results, "params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                                       for p in engine.module.parameters())}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
