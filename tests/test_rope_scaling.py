"""Llama 3.1 RoPE scaling (model.rope_scaling) reaches every consumer with the same numbers: the
megatron-core GPTModel, Megatron-LM's command line, the transformers config, and the launch script.
The frequencies are judged by the upstream code itself: megatron-core's RotaryEmbedding against
transformers' `ROPE_INIT_FUNCTIONS["llama3"]` (the two implementations of Meta's `apply_scaling`)."""

import json
from pathlib import Path

import pytest
import torch
from megatron_lm import FLAGS
from megatron_meta import meta_chunks

from toolkit.emit.launch import launch_script
from toolkit.emit.megatron import megatron_sections
from toolkit.emit.megatron_args import megatron_args
from toolkit.families.hf_config import check_matches, hf_config
from toolkit.plan.layout import resolve
from toolkit.plan.validate import validate

ONE_NODE = ("cluster=8xh100", "train.global_batch=256", "data=synthetic", "checks.memory=off")  # RoPE, not memory

# model overrides -> the llama3 scaling they must carry (None: plain RoPE)
CASES = {
    "llama3_8b": (["model=llama3_8b"], 8.0),
    "llama3_1b": (["model=llama3_1b"], 32.0),
    "llama3_8b-factor4": (["model=llama3_8b", "model.rope_scaling.factor=4"], 4.0),
    "llama3_8b-unscaled": (["model=llama3_8b", "model.rope_scaling.type=none"], None),
}


def megatron_inv_freq(cfg) -> torch.Tensor:
    """The inverse frequencies of the GPTModel that parakit's megatron trainer builds for `cfg`."""
    with meta_chunks(cfg) as (chunk,):
        return chunk.rotary_pos_emb.inv_freq.clone()


def transformers_inv_freq(m) -> torch.Tensor:
    """The inverse frequencies of the transformers model of the deepspeed backend (hf_config)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(config=hf_config(m)).inv_freq


@pytest.mark.parametrize("case", CASES)
def test_megatron_rope_frequencies_equal_transformers(compose, case):
    overrides, factor = CASES[case]
    cfg = compose(*overrides, *ONE_NODE)
    assert validate(cfg).ok, validate(cfg)
    ours = megatron_inv_freq(cfg)
    theirs = transformers_inv_freq(cfg.model)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    if factor is not None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        llama3, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_config(cfg.model), "cpu")
        torch.testing.assert_close(ours, llama3, rtol=1e-6, atol=0)
        assert attention_factor == 1.0  # llama3 leaves cos/sin unscaled: the frequencies are all of it
        # ... and scaling changed them: the lowest frequency is slowed by exactly the factor, the
        # highest is kept (wavelength far below original_max_position_embeddings / high_freq_factor).
        plain = transformers_inv_freq(compose(*overrides, *ONE_NODE, "model.rope_scaling.type=none").model)
        assert not torch.allclose(ours, plain)
        assert ours[-1] == pytest.approx(plain[-1].item() / factor, rel=1e-6)
        assert ours[0] == pytest.approx(plain[0].item(), rel=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_megatron_args_carry_rope_flags_megatron_lm_defines(compose, case):
    overrides, factor = CASES[case]
    cfg = compose(*overrides, *ONE_NODE)
    layout = resolve(cfg)
    args = megatron_args(cfg, layout, megatron_sections(cfg, layout))
    flags = {a.split()[0]: a.split()[1:] for a in args}
    assert set(flags) <= FLAGS, set(flags) - FLAGS
    # Megatron-LM parses --rotary-base as int and --rope-scaling-factor as float (arguments.py)
    assert int(flags["--rotary-base"][0]) == 500000
    if factor is None:
        assert "--use-rope-scaling" not in flags and "--rope-scaling-factor" not in flags
    else:
        assert flags["--use-rope-scaling"] == []
        assert float(flags["--rope-scaling-factor"][0]) == factor


@pytest.mark.parametrize("case", CASES)
def test_hf_config_round_trips_rope_parameters(compose, case, tmp_path):
    from transformers import AutoConfig

    overrides, factor = CASES[case]
    m = compose(*overrides).model
    hf_config(m).save_pretrained(tmp_path)
    params = AutoConfig.from_pretrained(tmp_path).rope_parameters
    if factor is None:
        assert params == {"rope_type": "default", "rope_theta": 500000.0}
    else:
        rs = m.rope_scaling
        assert params == {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    check_matches(m, str(tmp_path))


def _published_llama32_1b(path: Path, **rope_scaling) -> str:
    """A config.json as meta-llama/Llama-3.2-1B publishes it (transformers 4 format: rope_theta and
    rope_scaling at the top level), with `rope_scaling` changes."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "head_dim": 64,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
            **rope_scaling,
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "vocab_size": 128256,
    }
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_published_config_matches_conf_model_and_other_rope_is_refused(compose, tmp_path):
    m = compose("model=llama3_1b").model
    check_matches(m, _published_llama32_1b(tmp_path / "published"))
    with pytest.raises(
        ValueError,
        match=r"model.rope_scaling=\{'type': 'llama3', 'factor': 32.0.* vs \{'type': 'llama3', 'factor': 8.0",
    ):
        check_matches(m, _published_llama32_1b(tmp_path / "factor8", factor=8.0))
    with pytest.raises(
        ValueError, match=r"model.rope_scaling=\{'type': 'none'\} vs \{'type': 'llama3', 'factor': 32.0"
    ):
        check_matches(compose("model=llama3_1b", "model.rope_scaling.type=none").model, str(tmp_path / "published"))


def test_model_hf_reads_llama3_scaling_and_writes_it_back(compose, tmp_path):
    """model=hf takes the scaling of a published config.json (the same model as conf/model/llama3_1b),
    and the transformers config parakit writes for it (export, deepspeed) carries it back."""
    path = _published_llama32_1b(tmp_path / "published")
    m = compose("model=hf", f"model.hf_path={path}").model
    assert (m.rope_scaling.type, m.rope_scaling.factor, m.rotary_base) == ("llama3", 32.0, 500000.0)
    assert (m.rope_scaling.original_max_position_embeddings, m.rope_scaling.high_freq_factor) == (8192, 4.0)
    written = hf_config(m).rope_parameters
    assert written["rope_type"] == "llama3" and written["factor"] == 32.0 and written["rope_theta"] == 500000.0
    with pytest.raises(Exception, match="RoPE scaling 'yarn' is not supported"):
        compose("model=hf", f"model.hf_path={_published_llama32_1b(tmp_path / 'yarn', rope_type='yarn')}")


def test_launch_refuses_megatron_lm_entry_when_it_would_drop_the_factor(compose):
    """Megatron-LM's pretrain_gpt.py does not pass --rope-scaling-factor to its model (factor 8):
    launch.sh runs it for Llama 3.1 (factor 8) and refuses it for Llama 3.2 1B (factor 32)."""

    def megatron_lm_branch(*overrides):
        cfg = compose(*overrides, *ONE_NODE)
        text = launch_script(cfg, resolve(cfg))
        return text.split("megatron-lm ]]; then\n", 1)[1].split("\nfi\n", 1)[0]

    assert "pretrain_gpt.py" in megatron_lm_branch("model=llama3_8b")
    refused = megatron_lm_branch("model=llama3_1b")
    assert "ENTRY=" not in refused and "exit 2" in refused
    assert "model.rope_scaling.factor=32" in refused and "--rope-scaling-factor" in refused
