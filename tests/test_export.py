"""`parakit export` without training: the shard writer, the atomic publish, the clear errors, and
whole exports of checkpoints written here in the DeepSpeed formats (ZeRO 0-2 module states, the
pipeline's layer files) from a transformers model, which transformers must load back unchanged.
The exports of real training runs: test_train_megatron.py and test_train_deepspeed.py."""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from toolkit import cli
from toolkit.config.schema import Config
from toolkit.families.hf_config import hf_config
from toolkit.families.to_hf import megatron_layer_to_hf
from toolkit.formats.atomic import staged_directory
from toolkit.interop.hf_dir import ShardWriter, parse_size
from toolkit.train import checkpoint as ckpt

GPT2_TINY = [
    "model=gpt2_124m",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.ffn_hidden_size=256",
    "model.vocab_size=1000",
]


def test_sizes_parse_as_save_pretrained_writes_them():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("2GiB") == 2**31
    assert parse_size("1024") == 1024
    with pytest.raises(ValueError, match="not a size"):
        parse_size("5 parsecs")


def test_shards_hold_at_most_the_size_and_the_index_names_every_tensor(tmp_path):
    tensors = {f"t{i}": torch.full((250,), float(i)) for i in range(5)}  # 1000 bytes each
    writer = ShardWriter(tmp_path, max_shard_bytes=2000)
    for name, tensor in tensors.items():
        writer.add(name, tensor[:250])  # a view: written as a tensor of its own
    files = writer.finish()
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [
        "model.safetensors.index.json"
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5000 and sorted(index["weight_map"]) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(load_file(tmp_path / index["weight_map"][name])[name], tensor)
    assert not list(tmp_path.glob(".*"))  # no temporary names left


def test_one_shard_is_model_safetensors_without_index(tmp_path):
    writer = ShardWriter(tmp_path, max_shard_bytes=10**9)
    writer.add("w", torch.ones(3, dtype=torch.bfloat16))
    assert [f.name for f in writer.finish()] == ["model.safetensors"]
    assert load_file(tmp_path / "model.safetensors")["w"].dtype == torch.bfloat16


def test_a_failed_export_leaves_nothing_that_looks_finished(tmp_path):
    out = tmp_path / "hf"
    with pytest.raises(RuntimeError), staged_directory(out) as staging:
        (staging / "config.json").write_text("{}")
        raise RuntimeError("the reader failed half way")
    assert list(tmp_path.iterdir()) == []
    out.mkdir()
    with pytest.raises(FileExistsError, match="choose another --output"), staged_directory(out):
        pass


def test_checkpoint_names_of_the_norms_map_like_the_local_ones(compose):
    m = compose("model=tiny", "model.num_layers=1").model
    local = {
        "input_layernorm.weight": torch.randn(64),
        "pre_mlp_layernorm.weight": torch.randn(64),
        "self_attention.linear_qkv.weight": torch.randn(128, 64),
        "self_attention.linear_proj.weight": torch.randn(64, 64),
        "mlp.linear_fc1.weight": torch.randn(384, 64),
        "mlp.linear_fc2.weight": torch.randn(64, 192),
    }
    stored = dict(local)
    stored["self_attention.linear_qkv.layer_norm_weight"] = stored.pop("input_layernorm.weight")
    stored["mlp.linear_fc1.layer_norm_weight"] = stored.pop("pre_mlp_layernorm.weight")
    a, b = megatron_layer_to_hf(local, 0, m), megatron_layer_to_hf(stored, 0, m)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["model.layers.0.mlp.gate_proj.weight"], local["mlp.linear_fc1.weight"][:192])
    with pytest.raises(ValueError, match="no transformers place"):
        megatron_layer_to_hf({**local, "self_attention.q_layernorm.weight": torch.ones(16)}, 0, m)


# --- run directories and checkpoints written here ---------------------------------------------


def _run_dir(tmp_path: Path, cfg: Config) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(OmegaConf.structured(cfg), run / "config.yaml")
    return run


def _publish(run: Path, step: int, files: dict) -> Path:
    """A published checkpoint holding `files` ({relative path: object to torch.save})."""
    staging = ckpt.prepare(run / "checkpoints", step)
    for relative, content in files.items():
        (staging / relative).parent.mkdir(parents=True, exist_ok=True)
        torch.save(content, staging / relative)
    return ckpt.publish(run / "checkpoints", step, keep_last=10)


def _model(cfg: Config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config(cfg.model))


def _export(*args) -> int:
    return cli.main(["export", *map(str, args)])


def _assert_loads_the_same(out: Path, model) -> None:
    from transformers import AutoModelForCausalLM

    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    expected, got = model.state_dict(), loaded.state_dict()
    assert sorted(expected) == sorted(got)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_zero_module_states_export_and_load_back(tmp_path, compose, capsys):
    cfg = compose("model=tiny", "backend=deepspeed", "zero=1")
    run, model = _run_dir(tmp_path, cfg), _model(cfg)
    _publish(run, 3, {"state/mp_rank_00_model_states.pt": {"module": model.state_dict()}})
    assert _export(run, "--output", tmp_path / "hf", "--max-shard-size", "5MB") == 0, capsys.readouterr().err
    _assert_loads_the_same(tmp_path / "hf", model)
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == 50256 and config["architectures"] == ["LlamaForCausalLM"]
    assert (tmp_path / "hf" / "tokenizer.json").exists()  # the bundled corpus's GPT-2 BPE
    assert json.loads((tmp_path / "hf" / "parakit_export.json").read_text())["step"] == 3
    step = run / "checkpoints" / "step_00000003"  # the engine's own directory
    assert _export(step / "state", "-o", tmp_path / "hf2", "--no-tokenizer") == 0
    _assert_loads_the_same(tmp_path / "hf2", model)


def test_pipeline_layer_files_of_a_gpt2_model_export_and_load_back(tmp_path, compose, capsys):
    """GPT-2's names (learned positions, LayerNorm biases, lm_head tied to the embedding)."""
    from toolkit.train.deepspeed_pipe import pipeline_layers

    cfg = compose(*GPT2_TINY, "backend=deepspeed", "zero=1", "parallel.pp=2", "cluster.gpus_per_node=2")
    run, model = _run_dir(tmp_path, cfg), _model(cfg)
    layers = pipeline_layers(model, cfg.model.family)
    _publish(run, 1, {f"state/layer_{i:02d}-model_states.pt": layer.state_dict() for i, layer in enumerate(layers)})
    assert _export(run, "-o", tmp_path / "hf", "--no-tokenizer") == 0, capsys.readouterr().err
    _assert_loads_the_same(tmp_path / "hf", model)


def test_errors_name_the_path_and_the_fix(tmp_path, compose, capsys):
    def error(*args) -> str:
        assert _export(*args, "--output", tmp_path / "hf", "--no-tokenizer") == 1
        message = capsys.readouterr().err
        assert "Traceback" not in message and not (tmp_path / "hf").exists()
        return message

    assert "does not exist" in error(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "pass --config RUN_DIR/config.yaml" in error(tmp_path / "empty")
    cfg = compose("model=tiny", "backend=deepspeed", "zero=1")
    run, model = _run_dir(tmp_path, cfg), _model(cfg)
    assert "the run saved none" in error(run) and "checkpoint.interval_steps" in error(run)
    good = _publish(run, 1, {"state/mp_rank_00_model_states.pt": {"module": model.state_dict()}})
    bad = _publish(run, 2, {"state/mp_rank_00_model_states.pt": {"module": model.state_dict()}})
    with open(bad / "state" / "mp_rank_00_model_states.pt", "r+b") as f:
        f.write(b"garbage")
    assert "present: [1, 2]" in error(run, "--step", 5)
    message = error(run, "--step", 2)
    assert str(bad) in message and "fails its xxh3 checksum" in message and "--step N (present: [1])" in message
    assert _export(run, "--output", tmp_path / "hf", "--no-tokenizer") == 0  # the newest intact: step 1
    assert "skipped" in capsys.readouterr().err
    assert json.loads((tmp_path / "hf" / "parakit_export.json").read_text())["source"] == str(good)
    assert _export(run, "--output", tmp_path / "hf", "--no-tokenizer") == 1
    assert "already exists" in capsys.readouterr().err


def test_export_is_listed_and_a_bad_option_exits_2(capsys):
    assert cli.main(["--help"]) == 0 and "export" in capsys.readouterr().out
    assert cli.main(["export", "run", "--output", "x", "--max-shard-size", "lots"]) == 2
    assert cli.main(["export", "run"]) == 2  # --output missing


def test_the_tokenizer_is_the_one_the_training_data_names(tmp_path, compose):
    """A prepared prefix's PREFIX.tokenizer/ (its manifest says so); the bundled GPT-2 BPE for the
    bundled corpus; a tokenizer larger than the model's vocabulary is refused."""
    from toolkit.data import bundled as bundled_files
    from toolkit.formats.manifest import Manifest, manifest_path, tokenizer_dir
    from toolkit.interop.export import ExportError, load_tokenizer

    prefix = tmp_path / "web_text_document"
    bundled = bundled_files.load_tokenizer()
    bundled.add_tokens(["<|new|>"])  # 50,258 tokens: tells this tokenizer from the bundled one
    bundled.save_pretrained(tokenizer_dir(prefix))
    Manifest("web", "GPT2TokenizerFast", 50258, 50256, "uint16", 1, 10).write(manifest_path(prefix))
    assert len(load_tokenizer(compose("model=tiny", "model.vocab_size=50304", f"data.path={prefix}"), None)) == 50258
    assert len(load_tokenizer(compose("model=tiny", f"data.path={tmp_path / 'other'}"), None)) == 50257
    assert len(load_tokenizer(compose("model=tiny", "model.vocab_size=50304"), tokenizer_dir(prefix))) == 50258
    with pytest.raises(ExportError, match="more than model.vocab_size=50257"):
        load_tokenizer(compose("model=tiny", f"data.path={prefix}"), None)


def test_a_minority_dtype_joins_the_models_only_when_exact():
    from toolkit.interop.readers import _in_one_dtype

    exact = torch.tensor([1.0, 0.5, -2.0])  # bf16 holds these
    inexact = torch.tensor([1.0 + 2**-20])
    got = dict(_in_one_dtype(iter([("norm", exact), ("odd", inexact), ("ids", torch.arange(3))]), torch.bfloat16))
    assert got["norm"].dtype == torch.bfloat16 and torch.equal(got["norm"].float(), exact)
    assert got["odd"].dtype == torch.float32 and got["ids"].dtype == torch.int64


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, dtype",
    [
        (["model=tiny"], torch.bfloat16),  # (Llama fp32 also passes by hand)
        (GPT2_TINY, torch.float32),
        (["model=tiny_moe"], torch.float32),  # Mixtral: 4 experts a layer
        # Qwen3-MoE: QK norms, and layer 1 dense among the MoE layers
        (
            ["model=tiny_moe", "model.family=qwen3_moe", "model.qk_layernorm=true", "model.moe.dense_layers=[1]"],
            torch.bfloat16,
        ),
        # Qwen2-MoE: q/k/v biases, a gated shared expert, top-k not renormalised, layer 2 dense
        (
            [
                "model=tiny_moe",
                "model.family=qwen2_moe",
                "model.add_qkv_bias=true",
                "model.moe.norm_topk_prob=false",
                "model.moe.shared_expert_size=96",
                "model.moe.shared_expert_gate=true",
                "model.moe.dense_layers=[2]",
            ],
            torch.float32,
        ),
    ],
    ids=["llama_bf16", "gpt2_tied", "mixtral", "qwen3_moe_bf16", "qwen2_moe"],
)
def test_hf_to_megatron_to_hf_is_bit_for_bit(tmp_path, compose, model, dtype):
    """The import (`parakit convert hf-to-megatron`) then the export give back the very files'
    tensors: names, dtypes and bits (random weights; bf16 norms included)."""
    import subprocess

    from safetensors.torch import load_file
    from training_runs import python

    cfg = compose(*model)
    hf, meg, back = tmp_path / "hf", tmp_path / "megatron", tmp_path / "back"
    original = _model(cfg)
    with torch.no_grad():
        for param in original.parameters():
            param.normal_(0, 0.05)  # norms too: not all ones
    original.to(dtype).save_pretrained(hf)
    convert = [python(), "-m", "toolkit.cli", "convert", "hf-to-megatron", str(hf), "--output", str(meg)]
    result = subprocess.run(convert, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run = _run_dir(tmp_path, cfg)
    assert _export(meg, "--config", run / "config.yaml", "-o", back, "--no-tokenizer") == 0
    before, after = (load_file(d / "model.safetensors") for d in (hf, back))
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name].view(-1), tensor.view(-1)), name
