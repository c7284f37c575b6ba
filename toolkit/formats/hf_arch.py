"""The architecture of a local Hugging Face model directory, read from its config.json.

Pure Python (json only, no torch or transformers): `model=hf model.hf_path=DIR` composes with
it (toolkit/conf/model/hf.yaml), and the planner must run on a laptop without either.

Field names follow transformers' configuration classes (LlamaConfig, Qwen2Config, MistralConfig,
GPT2Config in transformers/models/*/configuration_*.py); a saved config.json leaves out the values
equal to PretrainedConfig's defaults, which is why a missing `tie_word_embeddings` means True.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
# The training sequence length is not part of a model's config.json.
DEFAULT_SEQ_LENGTH = 4096
# Fields compared between a configured model and the directory's config.json.
ARCHITECTURE = (
    "family",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "ffn_hidden_size",
    "vocab_size",
    "normalization",
    "activation",
    "position_embedding",
    "rotary_base",
    "rope_scaling",
    "tie_embeddings",
    "add_bias_linear",
    "add_qkv_bias",
    "norm_epsilon",
)


class HfConfigError(ValueError):
    """A model.hf_path that does not hold a supported Hugging Face model."""


def _fix() -> str:
    return "set model.hf_path to a local directory saved by transformers' save_pretrained (config.json + *.safetensors)"


def read_config(path: str | os.PathLike | None) -> dict:
    """DIR/config.json as a dict; HfConfigError naming model.hf_path and the fix otherwise."""
    if not path:
        raise HfConfigError(f"model=hf needs model.hf_path=DIR: {_fix()}")
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise HfConfigError(f"model.hf_path={path}: no such directory; {_fix()}")
    file = directory / "config.json"
    if not file.is_file():
        raise HfConfigError(f"model.hf_path={path}: no config.json in it; {_fix()}")
    stat = file.stat()
    return _read(str(file.resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=16)
def _read(file: str, mtime_ns: int, size: int) -> dict:  # mtime and size: re-read a changed file
    try:
        return json.loads(Path(file).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HfConfigError(f"model.hf_path: {file} is not readable JSON ({e}); {_fix()}") from None


# config.json's llama3 rope_scaling keys -> parakit's model.rope_scaling fields (RopeScalingConfig).
_LLAMA3_SCALING = {
    "factor": "factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "original_max_position_embeddings": "original_max_position_embeddings",
}
_NO_SCALING = {
    "type": "none",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}  # RopeScalingConfig's defaults


def _rope(c: dict, path) -> tuple[float, dict]:
    """RoPE base and scaling: `rope_theta` + `rope_scaling` (transformers 4) or `rope_parameters`
    (transformers 5). Plain RoPE and Llama 3.1's llama3 scaling map onto megatron-core's GPTModel."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    if kind == "default":
        return theta, dict(_NO_SCALING)
    if kind != "llama3":
        raise HfConfigError(
            f"model.hf_path={path}: RoPE scaling {kind!r} is not supported (plain RoPE or llama3); "
            "choose a model without that rope_scaling"
        )
    return theta, {"type": "llama3", **{ours: scaling[theirs] for theirs, ours in _LLAMA3_SCALING.items()}}


def _unsupported(path, what: str) -> HfConfigError:
    return HfConfigError(f"model.hf_path={path}: {what} is not supported; choose a model of a supported family")


def _llama_like(c: dict, family: str, path) -> dict:
    if c.get("hidden_act", "silu") != "silu":
        raise _unsupported(path, f"hidden_act={c['hidden_act']!r} (SwiGLU needs silu)")
    heads = c["num_attention_heads"]
    attention_bias, mlp_bias = bool(c.get("attention_bias", False)), bool(c.get("mlp_bias", False))
    if family == "llama" and attention_bias != mlp_bias:
        # megatron-core's add_bias_linear covers the attention output and both MLP projections.
        raise _unsupported(path, f"attention_bias={attention_bias} with mlp_bias={mlp_bias}")
    theta, scaling = _rope(c, path)
    window = c.get("sliding_window")
    if family == "qwen2" and not c.get("use_sliding_window", False):
        window = None  # Qwen2 keeps a sliding_window value that only use_sliding_window turns on
    return {
        "num_layers": c["num_hidden_layers"],
        "hidden_size": c["hidden_size"],
        "num_attention_heads": heads,
        "num_kv_heads": c.get("num_key_value_heads") or heads,
        "head_dim": c.get("head_dim") or c["hidden_size"] // heads,
        "ffn_hidden_size": c["intermediate_size"],
        "max_position_embeddings": c["max_position_embeddings"],
        "normalization": "RMSNorm",
        "norm_epsilon": float(c.get("rms_norm_eps", 1e-6)),
        "activation": "swiglu",
        "position_embedding": "rope",
        "rotary_base": theta,
        "rope_scaling": scaling,
        "add_bias_linear": attention_bias if family == "llama" else False,
        "add_qkv_bias": family == "qwen2" or attention_bias,
        "sliding_window": window if family in ("mistral", "qwen2") else None,
        "hidden_dropout": 0.0,
        "attention_dropout": float(c.get("attention_dropout", 0.0)),
    }


# GPT2Config.activation_function -> parakit's activation: gelu_new is the tanh approximation
# (transformers/activations.py NewGELUActivation), gelu the exact erf form.
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _gpt2(c: dict, path) -> dict:
    act = c.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        raise _unsupported(path, f"activation_function={act!r}")
    if c.get("scale_attn_by_inverse_layer_idx") or c.get("reorder_and_upcast_attn"):
        raise _unsupported(path, "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn")
    if not c.get("scale_attn_weights", True):
        raise _unsupported(path, "scale_attn_weights=false")
    hidden = c.get("n_embd", 768)
    return {
        "num_layers": c.get("n_layer", 12),
        "hidden_size": hidden,
        "num_attention_heads": c.get("n_head", 12),
        "num_kv_heads": None,
        "head_dim": None,
        "ffn_hidden_size": c.get("n_inner") or 4 * hidden,
        "max_position_embeddings": c.get("n_positions", 1024),
        "normalization": "LayerNorm",
        "norm_epsilon": float(c.get("layer_norm_epsilon", 1e-5)),
        "activation": _GPT2_ACTIVATIONS[act],
        "position_embedding": "learned_absolute",
        "rotary_base": 10000.0,
        "rope_scaling": dict(_NO_SCALING),
        "add_bias_linear": True,
        "add_qkv_bias": True,
        "sliding_window": None,
        "hidden_dropout": float(c.get("resid_pdrop", 0.1)),
        "attention_dropout": float(c.get("attn_pdrop", 0.1)),
    }


def model_fields(path: str | os.PathLike | None) -> dict:
    """The ModelConfig fields of the model in `path` (toolkit.config.schema.ModelConfig names)."""
    c = read_config(path)
    family = c.get("model_type")
    if family not in FAMILIES:
        raise HfConfigError(
            f"model.hf_path={path}: model_type {family!r} is not supported (supported: {', '.join(FAMILIES)}); "
            "choose a model of a supported family"
        )
    try:
        fields = _gpt2(c, path) if family == "gpt2" else _llama_like(c, family, path)
    except KeyError as e:
        raise HfConfigError(f"model.hf_path={path}: config.json has no {e.args[0]!r}; {_fix()}") from None
    positions = fields["max_position_embeddings"]
    return {
        "name": Path(str(path)).expanduser().resolve().name,
        "family": family,
        "vocab_size": c.get("vocab_size", 50257 if family == "gpt2" else 32000),
        "tie_embeddings": bool(c.get("tie_word_embeddings", True)),  # PretrainedConfig's default
        "init_method_std": float(c.get("initializer_range", 0.02)),
        "seq_length": min(positions, DEFAULT_SEQ_LENGTH),
        **fields,
    }


def field(name: str, path) -> object:
    """One ModelConfig field of the model in `path` (the `${hf:FIELD,PATH}` resolver); a nested
    field as `rope_scaling.factor`."""
    value = model_fields(path)
    for part in name.split("."):
        value = value[part]
    return value


def _same(ours, theirs) -> bool:
    if isinstance(theirs, dict):
        return isinstance(ours, dict) and ours.keys() == theirs.keys() and all(_same(ours[k], theirs[k]) for k in ours)
    if isinstance(theirs, float) or isinstance(ours, float):
        return ours is not None and theirs is not None and abs(float(ours) - float(theirs)) <= 1e-9 * abs(theirs)
    return str(ours) == str(theirs)


def mismatches(model, path) -> dict[str, tuple]:
    """{field: (configured, in config.json)} for each architecture field where the configured
    model (a ModelConfig) differs from the directory's; {} when they agree."""
    theirs = model_fields(path)
    ours = {name: getattr(model, name) for name in ARCHITECTURE}
    heads = model.num_attention_heads
    ours["num_kv_heads"] = model.num_kv_heads or heads  # None means as many as heads
    ours["head_dim"] = model.head_dim or model.hidden_size // heads
    theirs["num_kv_heads"] = theirs["num_kv_heads"] or theirs["num_attention_heads"]
    theirs["head_dim"] = theirs["head_dim"] or theirs["hidden_size"] // theirs["num_attention_heads"]
    if theirs["position_embedding"] != "rope":
        ours.pop("rotary_base")
    scaling = model.rope_scaling
    ours["rope_scaling"] = (
        {"type": str(scaling.type), **{f: getattr(scaling, f) for f in _LLAMA3_SCALING.values()}}
        if scaling.type == "llama3"
        else {"type": "none"}
    )
    if theirs["rope_scaling"]["type"] == "none":
        theirs["rope_scaling"] = {"type": "none"}
    differ = [name for name in ARCHITECTURE if name in ours and not _same(ours[name], theirs[name])]
    return {name: (ours[name], theirs[name]) for name in differ}


def describe(diff: dict[str, tuple]) -> str:
    """`model.FIELD=configured vs in config.json, ...`"""
    return ", ".join(f"model.{name}={a} vs {b}" for name, (a, b) in diff.items())


MISMATCH_FIX = "use model=hf model.hf_path={path} (reads the architecture from config.json), or set those fields"


def check_matches(model, path) -> None:
    """Refuse a configured model whose architecture differs from the one in `path`."""
    diff = mismatches(model, path)
    if diff:
        raise HfConfigError(
            f"model.hf_path={path} holds another architecture than model={model.name} (configured vs "
            f"config.json): {describe(diff)}. " + MISMATCH_FIX.format(path=path).capitalize()
        )
