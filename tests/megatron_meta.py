"""Build this rank's megatron-core GPTModel on the meta device inside a fake process group:
real module shapes for any tp x pp x vpp layout, in one process, with no memory and no peers
(the dry-run technique of torchtitan)."""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from unittest import mock

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from toolkit.emit.megatron import megatron_sections
from toolkit.plan.layout import resolve
from toolkit.train.mcore_cpu import _SynchronousStream


@contextmanager
def fake_rank(rank: int, world: int, tp: int, pp: int, vpp: int, ep: int = 1, etp: int | None = None):
    from toolkit.compat import import_shims

    import_shims()
    from megatron.core import parallel_state

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            create_gloo_process_groups=False,
        )
        yield parallel_state
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@contextmanager
def meta_chunks(
    cfg, tp: int = 1, pp: int = 1, vpp: int = 1, stage: int = 0, first=None, last=None, ep: int = 1, etp=None
):
    """The GPTModel chunks of tensor rank 0 of pipeline `stage`, parameters on the meta device
    (buffers that megatron-core computes on the CPU, such as RoPE's inv_freq, hold real values).
    Expert parallel folds into data-parallel ranks: dp is what the expert mesh needs."""
    from toolkit.train.megatron_model import build_model_chunks

    dp = max(ep * (etp or tp) // tp, 1)
    cfg = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(
            cfg.parallel,
            tp=tp,
            pp=pp,
            vpp=vpp,
            dp=None,
            cp=1,
            ep=ep,
            etp=etp,
            sequence_parallel=tp > 1 and ep > 1,
            first_stage_layers=first,
            last_stage_layers=last,
        ),
        cluster=dataclasses.replace(cfg.cluster, nodes=1, gpus_per_node=tp * pp * dp),
    )
    sections = megatron_sections(cfg, resolve(cfg))
    sections["model_parallel"].update(
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype="float32",
        pipeline_dtype="float32",
        bf16=False,
        fp16=False,
    )
    sections["transformer"].update(fp8=None, transformer_impl="local", init_model_with_meta_device=True)
    # Megatron orders ranks tp-fastest, pp outermost: the first rank of `stage` is stage * tp * dp.
    world = tp * pp * dp
    # the MoE token dispatcher makes a side stream when built (token_dispatcher.py): a CPU stand-in
    streams = mock.patch.object(torch.cuda, "Stream", _SynchronousStream)
    rank = fake_rank(stage * tp * dp, world, tp, pp, vpp, ep, etp)
    with attention_env_untouched(), streams, rank, torch.device("meta"):
        yield build_model_chunks(sections)


ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@contextmanager
def attention_env_untouched():
    """GPTModel sets NVTE_*_ATTN for its attention backend, and asserts that values already set
    agree with it: build without the test process's values, and leave them as they were (the
    training runs the tests start inherit this process's environment)."""
    saved = {name: os.environ.pop(name) for name in ATTENTION_ENV if name in os.environ}
    try:
        yield
    finally:
        for name in ATTENTION_ENV:
            os.environ.pop(name, None)
        os.environ.update(saved)


def megatron_rank_params(
    cfg, tp: int, pp: int, vpp: int, stage: int, first=None, last=None, ep: int = 1, etp: int | None = None
) -> dict:
    """{"total": n, "embedding": n, "output": n, "experts": n} for tensor rank 0 of pipeline `stage`
    (experts: the parameters megatron-core reduces over the expert-data-parallel ranks, allreduce=False)."""
    with meta_chunks(cfg, tp, pp, vpp, stage, first, last, ep, etp) as chunks:
        counts = {"total": 0, "embedding": 0, "output": 0, "experts": 0}
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                counts["total"] += p.numel()
                if name.startswith("embedding."):
                    counts["embedding"] += p.numel()
                if name.startswith("output_layer."):
                    counts["output"] += p.numel()
                if not getattr(p, "allreduce", True):
                    counts["experts"] += p.numel()
        return counts
