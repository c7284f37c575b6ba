"""Bytes of tensors megatron-core DDP + (distributed) optimizer hold per rank on CPU.

torchrun --nproc-per-node 2 tests/dist/mcore_model_states.py OUT.json [hydra overrides...]

Builds this rank's GPTModel chunks from the emitted megatron sections, wraps them in
megatron-core DDP and its optimizer, runs one step, then counts every live tensor storage (gc)
after the next step's backward and gradient reduction, before the update.
"""
import json
import sys

import torch
from live_tensors import live_tensor_bytes

from toolkit.train import mcore_cpu

mcore_cpu.enable()




def main():
    out, overrides = sys.argv[1], sys.argv[2:]
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from toolkit.config.store import compose_config
    from toolkit.emit.megatron import build_megatron_configs, megatron_sections
    from toolkit.plan.validate import check
    from toolkit.train.megatron_model import build_model_chunks

    cfg = compose_config(overrides)
    layout, _ = check(cfg)
    sections = megatron_sections(cfg, layout)
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(layout.tp, layout.pp)
    torch.manual_seed(cfg.train.seed)
    model_parallel_cuda_manual_seed(cfg.train.seed)
    baseline = live_tensor_bytes()
    transformer_config, optimizer_config, ddp_config = build_megatron_configs(sections)
    chunks = build_model_chunks(sections)
    model = [DistributedDataParallel(transformer_config, ddp_config, chunk) for chunk in chunks]
    optimizer = get_megatron_optimizer(optimizer_config, model)
    g = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())

    def step(measure: bool) -> int:
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        for _ in range(layout.grad_accum):
            tokens = torch.randint(0, cfg.model.vocab_size, (layout.micro_batch, layout.seq_length), generator=g)
            positions = torch.arange(layout.seq_length).unsqueeze(0).expand_as(tokens)
            loss = model[0](tokens, positions, None, labels=tokens).float().mean() / layout.grad_accum
            loss.backward()
            del loss
        finalize_model_grads(model)
        held = live_tensor_bytes() - baseline if measure else 0
        optimizer.step()
        return held

    step(measure=False)
    held = step(measure=True)
    results = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(results, {"rank": torch.distributed.get_rank(), "bytes": held})
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"ranks": results, "params": sum(p.numel() for c in chunks for p in c.parameters())}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
