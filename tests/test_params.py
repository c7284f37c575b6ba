"""Exact parameter counts equal those of the real model objects: megatron-core GPTModel (built
on the meta device in a fake process group, per pipeline stage and tensor-parallel shard) and the
transformers model of the same config."""

import pytest
import torch
from megatron_meta import megatron_rank_params

from toolkit.families.hf_config import hf_config
from toolkit.plan.layout import padded_vocab_size, stage_layer_counts
from toolkit.plan.params import all_stage_params, hf_model_params, model_params, stage_params

# model -> (tp, pp, vpp) layouts that split it evenly
LAYOUTS = {
    "tiny": [(1, 1, 1), (2, 2, 2), (4, 1, 1), (1, 4, 2)],
    "gpt2_124m": [(1, 1, 1), (2, 2, 1), (4, 3, 1), (2, 2, 3)],
    "llama3_1b": [(1, 1, 1), (8, 2, 1), (4, 2, 2)],
    "llama3_8b": [(1, 1, 1), (8, 4, 1), (2, 4, 2)],
    "llama3_70b": [(1, 1, 1), (8, 4, 5)],
    "llama3_405b": [(1, 1, 1), (8, 7, 3), (8, 16, 1, 7, 7)],  # Llama 3's 7 + 14 x 8 + 7 split
    "gpt3_175b": [(1, 1, 1), (8, 8, 1), (8, 4, 3), (4, 4, 2, 20, 20)],
    "qwen2_0_5b": [(1, 1, 1), (2, 4, 3)],
    "mistral_7b": [(1, 1, 1), (8, 4, 2)],
    "tiny_moe": [(1, 1, 1), (2, 2, 1)],
    "mixtral_8x7b": [(1, 1, 1), (8, 4, 2)],
    "qwen3_235b_a22b": [(1, 1, 1), (4, 2, 1)],  # 94 layers
}
CASES = [(model, *layout, None, None)[:6] for model, layouts in LAYOUTS.items() for layout in layouts]


def test_every_conf_model_is_covered():
    from toolkit.config.store import conf_dir

    # model=hf has no architecture of its own (config.json's: tests/test_hf_weights.py)
    assert {p.stem for p in (conf_dir() / "model").glob("*.yaml")} - {"hf"} == set(LAYOUTS)


@pytest.mark.parametrize(
    "model,tp,pp,vpp,first,last", CASES, ids=[f"{m}-tp{t}-pp{p}-vpp{v}-{f}-{la}" for m, t, p, v, f, la in CASES]
)
def test_stage_params_equal_megatron_gptmodel(compose, model, tp, pp, vpp, first, last):
    cfg = compose(f"model={model}")
    padded = padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by)
    layers = stage_layer_counts(cfg.model.num_layers, pp, vpp, first, last)
    for stage in range(pp):
        real = megatron_rank_params(cfg, tp, pp, vpp, stage, first, last)
        planned = all_stage_params(cfg.model, padded, tp, pp, layers, vpp)[stage]
        assert planned.total == real["total"], (stage, planned, real)
        assert planned.embedding == real["embedding"] and planned.output == real["output"], (stage, planned, real)


# MoE layouts: (model, tp, pp, vpp, ep, etp, overrides); the experts' weights are those
# megatron-core reduces over the expert-data-parallel ranks (allreduce=False)
MOE_CASES = [
    ("tiny_moe", 1, 1, 1, 2, None, ()),
    ("tiny_moe", 2, 1, 1, 2, None, ()),
    ("tiny_moe", 2, 1, 1, 2, 1, ()),
    ("tiny_moe", 1, 2, 2, 4, None, ()),
    ("tiny_moe", 2, 2, 1, 4, 1, ("model.moe.shared_expert_size=128", "model.moe.shared_expert_gate=true")),
    ("tiny_moe", 1, 2, 1, 2, None, ("model.moe.layer_freq=2",)),
    ("tiny_moe", 1, 2, 2, 2, None, ("model.moe.dense_layers=[0,3]", "model.qk_layernorm=true")),
    ("mixtral_8x7b", 8, 4, 1, 8, 1, ()),
    ("mixtral_8x7b", 2, 2, 2, 4, None, ()),
]


@pytest.mark.parametrize(
    "model,tp,pp,vpp,ep,etp,overrides", MOE_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(MOE_CASES)]
)
def test_moe_stage_params_equal_megatron_gptmodel(compose, model, tp, pp, vpp, ep, etp, overrides):
    cfg = compose(f"model={model}", *overrides)
    padded = padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by)
    planned = all_stage_params(cfg.model, padded, tp, pp, None, vpp, ep, etp or tp)
    for stage in range(pp):
        real = megatron_rank_params(cfg, tp, pp, vpp, stage, ep=ep, etp=etp)
        assert (planned[stage].total, planned[stage].experts) == (real["total"], real["experts"]), (stage, real)


def test_active_params_count_the_routed_experts(compose):
    """Mixtral 8x7B: 46.7B parameters, 12.9B active per token (Jiang et al. 2024, section 2)."""
    m = compose("model=mixtral_8x7b").model
    assert round(model_params(m) / 1e9, 1) == 46.7 and round(model_params(m, active=True) / 1e9, 1) == 12.9
    qwen3 = compose("model=qwen3_235b_a22b").model  # Qwen3 Technical Report, Table 2: 235B, 22B activated
    assert round(model_params(qwen3) / 1e9) == 235 and round(model_params(qwen3, active=True) / 1e9) == 22
    dense = compose("model=mistral_7b").model
    assert model_params(dense, active=True) == model_params(dense)


@pytest.mark.parametrize("model", sorted(LAYOUTS))
def test_model_params_equal_transformers_model(compose, model):
    from transformers import AutoModelForCausalLM

    m = compose(f"model={model}").model
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config(m))
    assert hf_model_params(m) == sum(p.numel() for p in hf.parameters())


def test_sum_over_shards_is_the_padded_model(compose):
    """Tensor shards add up to the whole model, except the replicated norms and row biases."""
    m = compose("model=gpt2_124m").model
    padded = padded_vocab_size(m.vocab_size, 128)
    whole = stage_params(m, padded, 1, 1, 0).total
    assert whole == model_params(m, padded)
    shards = sum(s.total for s in [stage_params(m, padded, 1, 2, st) for st in range(2)])
    assert shards == whole + padded * m.hidden_size  # the tied output layer's copy on the last stage
