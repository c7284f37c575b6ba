"""A local Hugging Face model directory's config.json: the file read (with the errors that name
model.hf_path and the fix), the architecture fields compared, and the RoPE fields every RoPE
family reads alike. Each family's own fields are its module's (toolkit.families).

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
    "qk_layernorm",
    "moe",
)
# model.moe's fields that are the architecture (config.json's), compared as "moe"
MOE_ARCHITECTURE = (
    "num_experts",
    "router_topk",
    "norm_topk_prob",
    "ffn_hidden_size",
    "shared_expert_size",
    "shared_expert_gate",
    "layer_freq",
    "dense_layers",
)


class HfConfigError(ValueError):
    """A model.hf_path that does not hold a supported Hugging Face model."""


HF_PATH_FIX = (
    "set model.hf_path to a local directory saved by transformers' save_pretrained (config.json + *.safetensors)"
)


def read_config(path: str | os.PathLike | None) -> dict:
    """DIR/config.json as a dict; HfConfigError naming model.hf_path and the fix otherwise."""
    if not path:
        raise HfConfigError(f"model=hf needs model.hf_path=DIR: {HF_PATH_FIX}")
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise HfConfigError(f"model.hf_path={path}: no such directory; {HF_PATH_FIX}")
    file = directory / "config.json"
    if not file.is_file():
        raise HfConfigError(f"model.hf_path={path}: no config.json in it; {HF_PATH_FIX}")
    stat = file.stat()
    return _read(str(file.resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=16)
def _read(file: str, mtime_ns: int, size: int) -> dict:  # mtime and size: re-read a changed file
    try:
        content = json.loads(Path(file).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HfConfigError(f"model.hf_path: {file} is not readable JSON ({e}); {HF_PATH_FIX}") from None
    if not isinstance(content, dict):
        raise HfConfigError(
            f"model.hf_path: {file} holds a JSON {type(content).__name__}, not an object; {HF_PATH_FIX}"
        )
    return content


# config.json's llama3 rope_scaling keys -> parakit's model.rope_scaling fields (RopeScalingConfig).
LLAMA3_SCALING = {
    "factor": "factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "original_max_position_embeddings": "original_max_position_embeddings",
}
NO_SCALING = {
    "type": "none",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}  # RopeScalingConfig's defaults


def rope_fields(c: dict, path) -> tuple[float, dict]:
    """RoPE base and scaling: `rope_theta` + `rope_scaling` (transformers 4) or `rope_parameters`
    (transformers 5). Plain RoPE and Llama 3.1's llama3 scaling map onto megatron-core's GPTModel."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    if kind == "default":
        return theta, dict(NO_SCALING)
    if kind != "llama3":
        raise HfConfigError(
            f"model.hf_path={path}: RoPE scaling {kind!r} is not supported (plain RoPE or llama3); "
            "choose a model without that rope_scaling"
        )
    return theta, {"type": "llama3", **{ours: scaling[theirs] for theirs, ours in LLAMA3_SCALING.items()}}


def unsupported(path, what: str) -> HfConfigError:
    return HfConfigError(f"model.hf_path={path}: {what} is not supported; choose a model of a supported family")
