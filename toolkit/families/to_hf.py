"""megatron-core GPTModel weights -> the transformers model of the same config, one transformer
layer at a time, by the model's family (toolkit.families). The padded vocabulary rows are
dropped; tensors keep their dtype.

Layer tensors are named as in a tp=1, pp=1 GPTModel's state dict without the
"decoder.layers.{i}." prefix; dist checkpoints name the norms as Transformer Engine fuses them
(megatron-core's sharded_state_dict_keys_map), which `megatron_layer_to_hf` accepts too.
"""

from __future__ import annotations

import re

from toolkit.config.schema import ModelConfig
from toolkit.families import family_of
from toolkit.families.experts import fused_in_memory

# A checkpoint's layers are stacked along a prepended axis (decoder.layers.X), or named one by one
# where dense and MoE layers mix (decoder.layers.3.X: megatron-core's moe_layer_freq as a list)
NAMED_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")

# Checkpoint names of the norms (TE's fused layer-norm linears) -> the local spec's module names.
_CHECKPOINT_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def megatron_layer_to_hf(layer: dict, i: int, m: ModelConfig) -> dict:
    """Transformer layer `i`'s megatron tensors (names without "decoder.layers.{i}.") -> its
    transformers tensors. A tensor with no place in the transformers model is an error."""
    src = {_CHECKPOINT_NAMES.get(k, k): v for k, v in layer.items() if not k.endswith("_extra_state")}
    try:
        out = family_of(m.family).layer_to_hf(src, i, m)
    except KeyError as missing:
        raise ValueError(f"layer {i} of the megatron weights has no {missing.args[0]} (model {m.name})") from None
    if src:
        raise ValueError(f"layer {i}: no transformers place for megatron tensors {sorted(src)} (model {m.name})")
    return out


def megatron_outer_to_hf(name: str, tensor, m: ModelConfig) -> dict:
    """One tensor outside the transformer layers -> {transformers name: tensor}; the output layer
    of a model with tied embeddings maps to nothing (transformers ties lm_head itself)."""
    return family_of(m.family).outer_to_hf(name, tensor, m)


def megatron_to_hf(state: dict, m: ModelConfig) -> dict:
    """A whole tp=1, pp=1 GPTModel state dict -> the transformers state dict (lm_head included
    also when tied: load_state_dict(strict=True) expects it)."""
    state = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    out: dict = {}
    for i in range(m.num_layers):
        prefix = f"decoder.layers.{i}."
        out.update(megatron_layer_to_hf({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, i, m))
    for name, tensor in state.items():
        if not name.startswith("decoder.layers."):
            out.update(megatron_outer_to_hf(name, tensor, m))
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = state["embedding.word_embeddings.weight"][: m.vocab_size]
    family = family_of(m.family)
    if family.experts is not None:  # the model's fused experts, not the per-expert files' names
        out = fused_in_memory(out, family.experts, [family.layer_prefix(i) for i in range(m.num_layers)])
    return out
