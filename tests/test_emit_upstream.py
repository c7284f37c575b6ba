"""The generated configurations are accepted by DeepSpeed's and megatron-core's own classes,
over a broad matrix of models x layouts x ZeRO x precision x recompute x backend."""

import dataclasses
import itertools
import logging

import pytest
from deepspeed_readback import check_deepspeed_readback
from upstream import deepspeed_accepts, megatron_accepts

from toolkit.emit.deepspeed import deepspeed_config
from toolkit.emit.megatron import megatron_sections
from toolkit.emit.megatron_args import megatron_args
from toolkit.plan.layout import resolve
from toolkit.plan.validate import validate

logging.getLogger("DeepSpeed").setLevel(logging.WARNING)

# (tp, pp, vpp, cp, sequence_parallel, tp_comm_overlap)
GPU_LAYOUTS = [
    (1, 1, 1, 1, False, False),
    (8, 1, 1, 1, True, False),
    (4, 2, 1, 1, True, True),
    (8, 4, 2, 1, True, False),
    (2, 2, 2, 2, False, False),
    (8, 8, 1, 1, True, False),
    (2, 1, 1, 1, False, False),
    (1, 2, 1, 1, False, False),
]
CPU_LAYOUTS = [
    (1, 1, 1, 1, False, False),
    (2, 1, 1, 1, False, False),
    (2, 2, 2, 1, False, False),
    (1, 4, 2, 1, False, False),
    (1, 2, 1, 2, False, False),
    (4, 1, 1, 1, True, False),
]
ZERO = [
    (0, "none", "none"),
    (1, "none", "none"),
    (2, "none", "none"),
    (3, "none", "none"),
    (2, "cpu", "none"),
    (3, "cpu", "cpu"),
]
PRECISION = ["fp32", "bf16", "fp16", "fp8"]
RECOMPUTE = ["none", "selective", "full"]
BACKEND = ["megatron", "deepspeed"]
MODELS = [
    ("tiny", "cpu"),
    ("gpt2_124m", "h100_cluster"),
    ("llama3_1b", "h100_cluster"),
    ("llama3_8b", "h100_cluster"),
    ("llama3_70b", "h100_cluster"),
    ("llama3_405b", "h100_cluster"),
    ("gpt3_175b", "a100_cluster"),
    ("qwen2_0_5b", "h100_cluster"),
    ("mistral_7b", "h100_cluster"),
]


def variants(base):
    layouts = CPU_LAYOUTS if base.cluster.device == "cpu" else GPU_LAYOUTS
    for (tp, pp, vpp, cp, sp, overlap), (stage, off_opt, off_par), dtype, recompute, backend in itertools.product(
        layouts, ZERO, PRECISION, RECOMPUTE, BACKEND
    ):
        yield dataclasses.replace(
            base,
            parallel=dataclasses.replace(
                base.parallel, tp=tp, pp=pp, vpp=vpp, cp=cp, sequence_parallel=sp, tp_comm_overlap=overlap
            ),
            zero=dataclasses.replace(base.zero, stage=stage, offload_optimizer=off_opt, offload_param=off_par),
            precision=dataclasses.replace(base.precision, dtype=dtype),
            recompute=dataclasses.replace(base.recompute, granularity=recompute),
            backend=dataclasses.replace(base.backend, name=backend),
        )


@pytest.mark.parametrize("model,cluster", MODELS, ids=[m for m, _ in MODELS])
def test_upstream_accepts_every_valid_composition(compose, model, cluster):
    base = compose(
        f"model={model}",
        f"cluster={cluster}",
        "train=pretrain",
        "train.global_batch=1024",
        "optim.warmup_steps=100",
        "model.seq_length=1024" if model != "tiny" else "model.seq_length=128",
        "data=synthetic",  # the layouts, not the data: mistral_7b's 32000 tokens < the corpus's GPT-2 BPE
        "checks.memory=off",  # and what upstream accepts, not what fits (tests/test_fit.py)
    )
    accepted = overlapped = 0
    for cfg in variants(base):
        if not validate(cfg).ok:
            continue
        accepted += 1
        layout = resolve(cfg)
        ds_json = deepspeed_config(cfg, layout)
        ds = deepspeed_accepts(ds_json, dp=layout.dp, mp=layout.tp * layout.pp)
        check_deepspeed_readback(cfg, layout, ds_json, ds)  # every key, read back as the config asks

        transformer, optimizer, ddp = megatron_accepts(megatron_sections(cfg, layout))
        assert transformer.tensor_model_parallel_size == layout.tp
        assert transformer.pipeline_model_parallel_size == layout.pp
        assert (transformer.virtual_pipeline_model_parallel_size or 1) == layout.vpp
        assert transformer.num_query_groups == (cfg.model.num_kv_heads or cfg.model.num_attention_heads)
        assert transformer.recompute_granularity == (
            None if cfg.recompute.granularity == "none" else cfg.recompute.granularity
        )
        assert optimizer.use_distributed_optimizer == ddp.use_distributed_optimizer == (cfg.zero.stage == 1)
        # the overlap reaches megatron-core with TE's layers, which alone have it
        assert transformer.tp_comm_overlap == cfg.parallel.tp_comm_overlap
        if cfg.parallel.tp_comm_overlap:
            overlapped += 1
            assert transformer.transformer_impl == "transformer_engine"
            assert "--tp-comm-overlap" in megatron_args(cfg, layout, megatron_sections(cfg, layout))
        # GPU interleaving sends while the next chunk computes, as Megatron-LM's default (the
        # planner hides those sends); batched sends cannot overlap; gloo sends one at a time
        interleaved_gpu = layout.vpp > 1 and cfg.cluster.device == "cuda"
        assert transformer.overlap_p2p_comm == interleaved_gpu
        assert transformer.batch_p2p_comm == (cfg.cluster.device == "cuda" and not interleaved_gpu)
        no_overlap = "--no-overlap-p2p-communication" in megatron_args(cfg, layout, megatron_sections(cfg, layout))
        assert no_overlap == (not interleaved_gpu)  # Megatron-LM overlaps by default (without vpp it turns it off)
        assert optimizer.lr == pytest.approx(layout.lr)
    # the matrix must exercise the upstream classes, not just the validator
    assert accepted >= 50, accepted
    if model in ("llama3_8b", "gpt3_175b"):  # tp4 x sp with the overlap is a valid layout of these
        assert overlapped
