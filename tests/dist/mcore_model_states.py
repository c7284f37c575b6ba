"""Bytes of tensors megatron-core DDP + (distributed) optimizer hold per rank on CPU.

torchrun --nproc-per-node 2 tests/dist/mcore_model_states.py CASES.json OUT.json

CASES.json is a list of hydra override lists with one parallel layout (tp, pp); OUT.json gets
one {"ranks": [{"rank", "bytes"}...], "params"} per case, in order. For each case: builds this
rank's GPTModel chunks from the emitted megatron sections, wraps them in megatron-core DDP and its
optimizer, runs one step, then counts every live tensor storage (gc) after the next step's
backward and gradient reduction, before the update. The cases share one process and
parallel_state, each measured in isolation: after each, megatron-core's caches of it are dropped
and the live bytes must be back where they were before it.
"""
import importlib
import json
import sys

import torch
from live_tensors import live_tensor_bytes, measure_cases

from toolkit.train import mcore_cpu

mcore_cpu.enable()
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads  # noqa: E402
from megatron.core.optimizer import get_megatron_optimizer  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

from toolkit.config.store import compose_config  # noqa: E402
from toolkit.emit.megatron import megatron_sections
from toolkit.train.megatron_configs import build_megatron_configs  # noqa: E402
from toolkit.plan.validate import check  # noqa: E402
from toolkit.train.megatron_model import build_model_chunks  # noqa: E402


def held_bytes(cfg, baseline: int) -> tuple[int, int]:
    """(Live bytes above baseline after the second step's reduction, parameter count) of one config."""
    layout, _ = check(cfg)
    sections = megatron_sections(cfg, layout)
    torch.manual_seed(cfg.train.seed)
    model_parallel_cuda_manual_seed(cfg.train.seed)
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
    return step(measure=True), sum(p.numel() for c in chunks for p in c.parameters())


def forget_model():
    """Drop what megatron-core keeps of a model in globals (a fresh process has none of it): the
    attention's scratch tensors in the global memory buffer, RotaryEmbedding.forward's lru_cache."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    parallel_state.get_global_memory_buffer().buffer.clear()
    RotaryEmbedding.forward.cache_clear()


def main():
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    cfgs = [compose_config(overrides) for overrides in cases]
    layouts = {(layout.tp, layout.pp) for layout, _ in map(check, cfgs)}
    assert len(layouts) == 1, f"one parallel layout for every case, not {layouts}"
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(*layouts.pop())
    model_parallel_cuda_manual_seed(cfgs[0].train.seed)  # the RNG tracker's states: in the baseline
    # build_model_chunks imports the GPT modules lazily, and with them a 4-byte class tensor
    # (MTPLossAutoScaler's): imported before the baseline, so that no case counts it.
    importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    measure_cases(cases, cfgs, held_bytes, forget_model, sys.argv[2])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
