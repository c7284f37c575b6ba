"""Hugging Face weights in: `model=hf model.hf_path=DIR` composes the architecture of DIR's
config.json, and megatron-core models built from the weights at tp {1, 2} x pp {1, 2} (and
vpp = 2) compute the logits of the transformers model within 1e-4 (fp32), for the Llama, Qwen2,
Mistral and GPT-2 families; a checkpoint of `parakit convert hf-to-megatron` (written at tp = 1)
loads at tp = 2 x pp = 2. Bad directories and architecture mismatches are one clear error.

Mutation (made by hand, then restored): K and V swapped in toolkit.families.qkv.
interleave_qkv moved the logits by 2.8 to 3.7: every family failed, and the converted checkpoint."""

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from training_runs import processes_naming, python

from toolkit.config.store import compose_config
from toolkit.families.hf_config import check_matches
from toolkit.formats.hf_arch import HfConfigError

TESTS = Path(__file__).parent
QWEN2_CONFIG = TESTS / "data" / "hf_qwen2"  # a config.json only
FAMILIES = ["llama", "qwen2", "mistral", "gpt2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe"]
LAYOUTS = [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 2, 2)]  # (tp, pp, vpp) on 4 ranks
# (tp, pp, vpp, ep): the experts split 2 or 4 ways, with tensor parallel (etp following it) or pipeline
MOE_LAYOUTS = [(2, 1, 1, 2), (1, 2, 2, 2), (1, 1, 1, 4)]
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")
# Llama runs every layout; the other dense families map the same tensors but for their biases,
# norms, positions or QK norms, so each is split by tp and by tp x pp x vpp only (the launch's time);
# Qwen2-MoE differs from Qwen3-MoE by its shared expert (split by tp) and q/k/v biases
SPLIT = [(2, 1, 1, 1), (2, 2, 2, 1)]
FEWER_LAYOUTS = {
    "qwen2": SPLIT,
    "mistral": SPLIT,
    "gpt2": SPLIT,
    "qwen3": SPLIT,
    "qwen2_moe": [(2, 1, 1, 2), (1, 2, 2, 2)],
}


def _layouts(family):
    if family in FEWER_LAYOUTS:
        return FEWER_LAYOUTS[family]
    return MOE_LAYOUTS if family in MOE_FAMILIES else [(*layout, 1) for layout in LAYOUTS]


# Measured: at most 2.0e-6 over every family and layout (logits up to ~3.2 in size).
TOLERANCE = 1e-4


def _name(family, tp, pp, vpp, ep=1):
    return f"{family}-tp{tp}-pp{pp}-vpp{vpp}" + (f"-ep{ep}" if ep > 1 else "")


# ------------------------------------------------------------------ composition and clear errors
def _config_dir(tmp_path, **config) -> Path:
    directory = tmp_path / "hf"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_model_hf_composes_the_architecture_of_config_json():
    m = compose_config(["model=hf", f"model.hf_path={QWEN2_CONFIG}"]).model
    assert (m.name, m.family, m.num_layers, m.hidden_size, m.ffn_hidden_size) == ("hf_qwen2", "qwen2", 4, 64, 96)
    assert (m.num_attention_heads, m.num_kv_heads, m.head_dim, m.vocab_size) == (4, 2, 16, 1000)
    assert (m.normalization, m.activation, m.position_embedding) == ("RMSNorm", "swiglu", "rope")
    assert (m.rotary_base, m.norm_epsilon, m.tie_embeddings) == (1e6, 1e-6, True)
    assert (m.add_qkv_bias, m.add_bias_linear) == (True, False)  # Qwen2: q, k, v biases only
    assert m.sliding_window is None  # use_sliding_window=false leaves sliding_window off
    assert (m.max_position_embeddings, m.seq_length) == (64, 64)
    # Fields stay overridable after config.json's.
    assert compose_config(["model=hf", f"model.hf_path={QWEN2_CONFIG}", "model.seq_length=32"]).model.seq_length == 32


def test_model_hf_reads_gpt2_names(tmp_path):
    path = _config_dir(tmp_path, model_type="gpt2", n_embd=32, n_layer=2, n_head=2, vocab_size=500, n_positions=16)
    m = compose_config(["model=hf", f"model.hf_path={path}"]).model
    assert (m.family, m.hidden_size, m.ffn_hidden_size, m.num_layers, m.vocab_size) == ("gpt2", 32, 128, 2, 500)
    assert (m.activation, m.normalization, m.position_embedding) == ("gelu_tanh", "LayerNorm", "learned_absolute")
    assert (m.tie_embeddings, m.add_bias_linear, m.add_qkv_bias) == (True, True, True)  # tied: PretrainedConfig default


LLAMA = {**json.loads((QWEN2_CONFIG / "config.json").read_text()), "model_type": "llama"}


@pytest.mark.parametrize(
    "config, expected",
    [
        (None, "model=hf needs model.hf_path=DIR"),
        ("missing", "no such directory"),
        ("empty", "no config.json"),
        (
            {"model_type": "bert"},
            "model_type 'bert' is not supported (supported: llama, qwen2, mistral, gpt2, mixtral, qwen3, qwen3_moe, "
            "qwen2_moe)",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=True with mlp_bias=False"),
        ({"intermediate_size": None}, "config.json has no 'intermediate_size'"),
        # a value of another type: the key at fault is named, whichever the arithmetic met first
        ({"num_attention_heads": "14", "head_dim": None}, "config.json's num_attention_heads='14' does not make"),
        ({"hidden_size": "896", "head_dim": None}, "config.json's hidden_size='896' does not make"),
        ({"num_hidden_layers": [24]}, "num_hidden_layers=[24]"),
    ],
)
def test_a_bad_hf_path_is_one_clear_error(tmp_path, capsys, config, expected):
    overrides = ["model=hf"]
    if config == "missing":
        overrides.append(f"model.hf_path={tmp_path / 'absent'}")
    elif config == "empty":
        overrides.append(f"model.hf_path={tmp_path}")
    elif config is not None:
        fields = {k: v for k, v in {**LLAMA, **config}.items() if v is not None}
        overrides.append(f"model.hf_path={_config_dir(tmp_path, **fields)}")
    with pytest.raises(HfConfigError, match="model.hf_path") as error:
        compose_config(overrides)
    assert expected in str(error.value)
    # The command line says the same in one line, without a traceback.
    from toolkit.cli import main

    assert main(["validate", *overrides]) == 1
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_an_architecture_mismatch_names_each_field_and_the_fix():
    m = compose_config(["model=tiny", f"model.hf_path={QWEN2_CONFIG}"]).model
    with pytest.raises(HfConfigError) as error:
        check_matches(m, QWEN2_CONFIG)  # what the trainers check before reading weights
    message = str(error.value)
    for field in ("model.family=llama vs qwen2", "model.num_layers=8 vs 4", "model.vocab_size=50257 vs 1000"):
        assert field in message
    assert f"model=hf model.hf_path={QWEN2_CONFIG}" in message
    check_matches(compose_config(["model=hf", f"model.hf_path={QWEN2_CONFIG}"]).model, QWEN2_CONFIG)  # agrees


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_validate_refuses_a_mismatched_or_missing_hf_path_and_accepts_model_hf(tmp_path, backend):
    from toolkit.plan.validate import validate

    def rules(*overrides):
        cfg = compose_config([*overrides, "data=synthetic", f"backend={backend}", "zero=1"])
        return {v.rule: v for v in validate(cfg).errors}

    mismatch = rules("model=tiny", f"model.hf_path={QWEN2_CONFIG}")["hf_path_architecture"]
    assert mismatch.fields["model.num_layers"] == 8 and "model.num_layers=8 vs 4" in mismatch.message
    assert f"model=hf model.hf_path={QWEN2_CONFIG}" in mismatch.fix
    assert "no such directory" in rules("model=tiny", f"model.hf_path={tmp_path / 'absent'}")["hf_path"].message
    # The neighbour: the same architecture with model=hf (both backends read Hugging Face weights),
    # in a directory that has weights (the validator looks for the files, not into them).
    with_weights = tmp_path / "with_weights"
    with_weights.mkdir()
    shutil.copy(QWEN2_CONFIG / "config.json", with_weights)
    (with_weights / "model.safetensors").touch()
    assert not rules("model=hf", f"model.hf_path={with_weights}")


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_an_hf_directory_without_weights_is_refused_before_any_rank_starts(tmp_path, capsys, backend):
    """Every rank would open the weights (HfTensors on megatron, from_pretrained on deepspeed) and
    fail: the validator names model.hf_path, what is missing and the fix, once, before launch."""
    from toolkit.cli import main
    from toolkit.plan.validate import validate

    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(QWEN2_CONFIG / "config.json", hf)
    overrides = ["model=hf", f"model.hf_path={hf}", "data=synthetic", f"backend={backend}", "zero=1"]

    def weights_error(*more):
        return {v.rule: v for v in validate(compose_config([*overrides, *more])).errors}.get("hf_weights")

    error = weights_error()
    assert error and error.fields == {"model.hf_path": str(hf)} and "no weights" in error.message, error
    assert "save_pretrained" in error.fix and "train.init_checkpoint" in error.fix
    assert main(["validate", *overrides]) == 2 and "[hf_weights]" in capsys.readouterr().err
    # An index naming a shard that is not there; the neighbour: every shard there.
    shards = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict(zip("ab", shards))}))
    (hf / shards[0]).touch()
    error = weights_error()
    assert shards[1] in error.message and shards[0] not in error.message, error
    (hf / shards[1]).touch()
    assert weights_error() is None
    # PyTorch's pytorch_model.bin: transformers' from_pretrained reads it, HfTensors does not.
    for path in [hf / "model.safetensors.index.json", *(hf / s for s in shards)]:
        path.unlink()
    (hf / "pytorch_model.bin").touch()
    assert (weights_error() is None) == (backend == "deepspeed")


def test_an_init_checkpoint_replaces_the_hf_weights(tmp_path):
    """megatron's setup loads train.init_checkpoint instead of model.hf_path's weights: a directory
    with config.json only is enough then (README: convert once, train from the checkpoint)."""
    from toolkit.plan.validate import validate

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (checkpoint / "manifest.json").write_text('{"files": {}}')  # sealed, as parakit writes one
    overrides = ["model=hf", f"model.hf_path={QWEN2_CONFIG}", "data=synthetic"]
    assert "hf_weights" in {v.rule for v in validate(compose_config(overrides)).errors}
    assert not validate(compose_config([*overrides, f"train.init_checkpoint={checkpoint}"])).errors


def test_qkv_interleave_is_the_inverse_of_the_megatron_to_hf_split():
    import torch

    from toolkit.families.qkv import interleave_qkv, split_qkv

    m = compose_config(["model=hf", f"model.hf_path={QWEN2_CONFIG}"]).model
    q, k, v = torch.randn(64, 8), torch.randn(32, 8), torch.randn(32, 8)
    for got, want in zip(split_qkv(interleave_qkv(q, k, v, m), m), (q, k, v)):
        assert torch.equal(got, want)


def test_gpt2_activation_is_megatron_lms_openai_gelu():
    from toolkit.emit.megatron import megatron_sections
    from toolkit.emit.megatron_args import megatron_args
    from toolkit.plan.layout import resolve

    cfg = compose_config(["model=gpt2_124m", "model.activation=gelu_tanh", "data=synthetic"])
    sections = megatron_sections(cfg, resolve(cfg))
    assert sections["transformer"]["activation_func"] == "gelu_tanh"
    assert "--openai-gelu" in megatron_args(cfg, resolve(cfg), sections)


# ------------------------------------------------------------------ logits at every layout (one launch)
@pytest.fixture(scope="module")
def logits(tmp_path_factory):
    """Tiny models of each family, their transformers logits, and the megatron logits of one
    4-rank launch over every layout (plus a converted checkpoint loaded at tp=2 x pp=2)."""
    import torch
    from hf_models import make_model

    tmp = tmp_path_factory.mktemp("hf")
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp / "tokens.pt")
    expected, cases = {}, []
    for family in FAMILIES:
        model = make_model(family, tmp / family)
        with torch.no_grad():
            expected[family] = model(input_ids=tokens, position_ids=torch.arange(16).expand(2, -1)).logits
        for layout in _layouts(family):
            overrides = ["model=hf", f"model.hf_path={tmp / family}"]
            cases.append({"name": _name(family, *layout), "overrides": overrides, "layout": list(layout)})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS.parent)}
    converted = str(tmp / "qwen2-megatron")
    convert = subprocess.run(
        [python(), "-m", "toolkit.cli", "convert", "hf-to-megatron", str(tmp / "qwen2"), "--output", converted],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert convert.returncode == 0, convert.stderr[-3000:]
    overrides = ["model=hf", f"model.hf_path={tmp / 'qwen2'}"]
    cases.append({"name": "converted", "overrides": overrides, "layout": [2, 2, 1], "init_checkpoint": converted})
    (tmp / "cases.json").write_text(json.dumps(cases))
    out = tmp / "out"
    out.mkdir()
    command = [python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    command += [str(TESTS / "dist" / "hf_logits.py"), str(tmp / "cases.json"), str(tmp / "tokens.pt"), str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    time.sleep(1)
    left = processes_naming(str(tmp))
    assert not left, f"processes left behind: {left}"
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = {case["name"]: torch.load(out / f"{case['name']}.pt") for case in cases}
    yield {"expected": expected, "got": got, "convert_stdout": convert.stdout}
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_logits_equal_transformers_at_every_layout(logits, family):
    expected = logits["expected"][family]
    for layout in _layouts(family):
        got = logits["got"][_name(family, *layout)]
        assert got.shape == expected.shape, _name(family, *layout)
        difference = (got - expected).abs().max().item()
        assert difference <= TOLERANCE, f"{_name(family, *layout)}: logits differ by {difference}"


@pytest.mark.slow
def test_a_converted_checkpoint_loads_at_another_tp_and_pp(logits):
    """Written at tp=1, loaded at tp=2 x pp=2 (the vocabulary padded to 1152 at both: the padding
    is the model's) with tied embeddings."""
    difference = (logits["got"]["converted"] - logits["expected"]["qwen2"]).abs().max().item()
    assert difference <= TOLERANCE, difference
    assert "train.init_checkpoint=" in logits["convert_stdout"]
