"""`parakit convert hf-to-megatron HF_DIR --output DIR`: a Hugging Face model directory as a
megatron-core dist checkpoint (torch_dist), which `train.init_checkpoint=DIR` loads at any
tp/pp/vpp/dp layout.

The conversion runs in this process at tp = pp = 1: dist_checkpointing stores every tensor with
global offsets and reshards on load, and the embedding and output layer are saved with
megatron-core's allow_shape_mismatch (language_module.py, tensor_parallel/layers.py), so a
checkpoint converted before the padding became the model's (make_vocab_size_divisible_by alone,
the same at every tp) still loads where the padding differs (the missing rows are zero).
The weights are read tensor by tensor (toolkit.families.hf_weights): the process holds the
model once plus about one tensor, not a second copy of the model (megatron-core's
dist_checkpointing.save takes the whole sharded state dict at once, so the model itself is held).
"""

from __future__ import annotations

import dataclasses
import resource
from pathlib import Path

import torch

from toolkit.config.schema import Config
from toolkit.formats.atomic import staged_directory
from toolkit.train import mcore_cpu
from toolkit.train.checkpoint import model_record, seal


def checkpoint_dtype(path: str) -> str:
    """bf16 for Hugging Face weights saved in bfloat16 (config.json's `dtype`, `torch_dtype` before
    transformers 5): kept as they are, half the memory and disk of fp32; fp32 otherwise.
    megatron-core loads either into a model of any precision (the tensors are cast on load)."""
    from toolkit.formats.hf_arch import read_config

    c = read_config(path)
    return "bf16" if c.get("dtype", c.get("torch_dtype")) == "bfloat16" else "fp32"


def single_process(cfg: Config, dtype: str = "fp32") -> Config:
    """`cfg` at tp = pp = 1 on one CPU process in `dtype` (the conversion's own layout)."""
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(
            cfg.parallel,
            tp=1,
            pp=1,
            vpp=1,
            cp=1,
            dp=None,
            sequence_parallel=False,
            first_stage_layers=None,
            last_stage_layers=None,
        ),
        cluster=dataclasses.replace(cfg.cluster, device="cpu", nodes=1, gpus_per_node=1),
        precision=dataclasses.replace(cfg.precision, dtype=dtype),
        zero=dataclasses.replace(cfg.zero, stage=0),
        train=dataclasses.replace(cfg.train, global_batch=cfg.train.micro_batch, grad_accum=None),
    )


def convert_hf_to_megatron(cfg: Config, output: str | Path) -> dict:
    """Write the weights of cfg.model.hf_path to `output` as a megatron-core dist checkpoint;
    returns what it measured: parameters, largest tensor and peak resident memory (bytes)."""
    mcore_cpu.enable()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from toolkit.emit.megatron import megatron_sections
    from toolkit.families.hf_weights import load_hf_into_chunks
    from toolkit.plan.layout import resolve
    from toolkit.train.distributed import init_process_group
    from toolkit.train.megatron_model import build_model_chunks

    cfg = single_process(cfg, checkpoint_dtype(cfg.model.hf_path))
    init_process_group()
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(cfg.train.seed)
    try:
        (chunk,) = build_model_chunks(megatron_sections(cfg, resolve(cfg)))
        load_hf_into_chunks([chunk], cfg.model.hf_path, cfg.model)
        with staged_directory(Path(output)) as staging:  # a failure leaves no checkpoint that looks whole
            dist_checkpointing.save({"chunk0": chunk.sharded_state_dict()}, str(staging))
            seal(staging, model_record(cfg))  # what train.init_checkpoint verifies before it reads
        params = list(chunk.parameters())
        return {
            "parameters": sum(p.numel() for p in params),
            "model_bytes": sum(p.numel() * p.element_size() for p in params),
            "largest_tensor_bytes": max(p.numel() * p.element_size() for p in params),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        }
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
