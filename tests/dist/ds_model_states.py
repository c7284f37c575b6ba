"""Bytes of tensors a DeepSpeed engine holds per rank, for the planner comparison.

torchrun --nproc-per-node 2 tests/dist/ds_model_states.py CASES.json OUT.json

CASES.json is a list of hydra override lists; OUT.json gets one {"ranks": [{"rank", "bytes"}...],
"params"} per case, in order. For each case: builds the transformers model of the composed
config, initialises DeepSpeed with the JSON parakit emits, runs one optimizer step (so Adam
states exist), then a forward and backward of the next step, and counts every live tensor
storage (gc) at that point: weights, gradients, optimizer states and DeepSpeed's buffers, without
activations (freed by backward). The cases share one process, each measured in isolation: after
each, the engine is destroyed, DeepSpeed's globals forget it, and the live bytes must be back at
the baseline.
"""
import importlib
import inspect
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402
from live_tensors import live_tensor_bytes, measure_cases  # noqa: E402

# No C++ compiler needed: gloo does every collective (DeepSpeed's shm op is an optimisation).
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
import deepspeed  # noqa: E402
from deepspeed.runtime.zero import parameter_offload  # noqa: E402
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from toolkit.config.store import compose_config  # noqa: E402
from toolkit.emit.deepspeed import deepspeed_config  # noqa: E402
from toolkit.families.hf_config import hf_config  # noqa: E402
from toolkit.plan.validate import check  # noqa: E402


def held_bytes(cfg, baseline: int) -> tuple[int, int]:
    """(Most live bytes above baseline after a backward of the second step, parameter count)."""
    layout, _ = check(cfg)
    ds_json = deepspeed_config(cfg, layout)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(cfg.model))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_json)
    del model
    g = torch.Generator().manual_seed(torch.distributed.get_rank())

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
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    engine.destroy()
    return held, params


def forget_engine():
    """Drop what ZeRO-3 keeps of an engine after destroy() (a fresh process has none of it): the
    model on FWD_MODULE_STACK, its parameter coordinator in a method's lru_cache."""
    parameter_offload.FWD_MODULE_STACK.clear()
    release = PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
    inspect.getclosurevars(release).nonlocals["func"].cache_clear()  # under @instrument_w_nvtx


def main():
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    cfgs = [compose_config(overrides) for overrides in cases]
    deepspeed.init_distributed(dist_backend="gloo")
    measure_cases(cases, cfgs, held_bytes, forget_engine, sys.argv[2])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
