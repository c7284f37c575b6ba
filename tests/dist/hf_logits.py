"""Logits of megatron-core models whose weights come from Hugging Face directories, at several
tp/pp/vpp layouts in one launch (parallel_state is rebuilt for each layout).

torchrun --nproc-per-node 4 tests/dist/hf_logits.py CASES.json TOKENS.pt OUT_DIR

CASES.json: a list of {"name", "overrides", "layout": [tp, pp, vpp(, ep)], "init_checkpoint"?}; each
case builds this rank's chunks from the composed config, fills them from model.hf_path
(toolkit.families.hf_weights), or from a megatron-core dist checkpoint when init_checkpoint is
given, and runs a forward-only pipeline schedule over TOKENS.pt (one micro-batch per sequence).
The last pipeline stage gathers the vocabulary-parallel logits over tp, drops the padded rows
and, on the first tp and dp rank, saves them as OUT_DIR/NAME.pt.
"""

import json
import sys
from pathlib import Path

import torch

from toolkit.train import mcore_cpu

mcore_cpu.enable()
from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

from toolkit.config.store import compose_config  # noqa: E402
from toolkit.emit.megatron import megatron_sections  # noqa: E402
from toolkit.families.hf_weights import load_hf_into_chunks  # noqa: E402
from toolkit.plan.layout import resolve  # noqa: E402
from toolkit.train.distributed import init_process_group  # noqa: E402
from toolkit.train.megatron_backend import _load_weights  # noqa: E402
from toolkit.train.megatron_model import build_model_chunks  # noqa: E402


def logits_of(case: dict, tokens: torch.Tensor) -> torch.Tensor | None:
    tp, pp, vpp, *rest = case["layout"]
    ep = rest[0] if rest else 1
    world = torch.distributed.get_world_size()
    cfg = compose_config(
        [
            *case["overrides"],
            "precision=fp32",
            "data=synthetic",
            f"cluster.gpus_per_node={world}",
            f"parallel.tp={tp}",
            f"parallel.pp={pp}",
            f"parallel.vpp={vpp}",
            f"parallel.ep={ep}",
            f"train.micro_batch=1",
            f"train.global_batch={len(tokens) * world // (tp * pp)}",
            f"model.seq_length={tokens.shape[1]}",
        ]
    )
    parallel_state.initialize_model_parallel(
        tp, pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, expert_model_parallel_size=ep
    )
    model_parallel_cuda_manual_seed(cfg.train.seed)
    layout = resolve(cfg)
    chunks = build_model_chunks(megatron_sections(cfg, layout))
    if case.get("init_checkpoint"):
        _load_weights(chunks, case["init_checkpoint"])
    else:
        load_hf_into_chunks(chunks, cfg.model.hf_path, cfg.model)
    for chunk in chunks:
        chunk.eval()
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    gathered = []

    def keep(output):
        gathered.append(gather_from_tensor_model_parallel_region(output)[..., : cfg.model.vocab_size])
        return output.sum() * 0.0, {}

    def forward_step(data_iterator, model):
        batch = next(data_iterator) if data_iterator is not None else None
        return model(batch, positions if batch is not None else None, None), keep

    batches = [t.unsqueeze(0) for t in tokens]
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(batches),
            seq_length=tokens.shape[1],
            micro_batch_size=1,
            forward_only=True,
        )
    keeps = (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    parallel_state.destroy_model_parallel()
    return torch.cat(gathered) if keeps else None


def main():
    cases, tokens, out = json.loads(Path(sys.argv[1]).read_text()), torch.load(sys.argv[2]), Path(sys.argv[3])
    init_process_group()
    for case in cases:
        logits = logits_of(case, tokens)
        if logits is not None:
            torch.save(logits, out / f"{case['name']}.pt")
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
