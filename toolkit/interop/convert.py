"""megatron-core GPTModel weights -> the transformers model of the same config (Llama- or
GPT-2-style), one transformer layer at a time.

megatron-core fuses Q, K and V into one linear_qkv whose rows are grouped by KV group:
[q heads of group 0, k of group 0, v of group 0, q heads of group 1, ...]; transformers keeps
q_proj/k_proj/v_proj (Llama) or one c_attn of [all q, all k, all v] stored transposed (GPT-2's
Conv1D). SwiGLU's linear_fc1 holds [gate; up]. The padded vocabulary rows are dropped. Tensors
keep their dtype.

Layer tensors are named as in a tp=1, pp=1 GPTModel's state dict without the
"decoder.layers.{i}." prefix; dist checkpoints name the norms as Transformer Engine fuses them
(megatron-core's sharded_state_dict_keys_map), which `megatron_layer_to_hf` accepts too.
"""

from __future__ import annotations

import torch

from toolkit.config.schema import ModelConfig
from toolkit.plan.params import head_dim, kv_heads

# Checkpoint names of the norms (TE's fused layer-norm linears) -> the local spec's module names.
_CHECKPOINT_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def _split_qkv(weight: torch.Tensor, m: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = kv_heads(m), head_dim(m)
    per_group = m.num_attention_heads // groups
    w = weight.reshape(groups, per_group + 2, d, *weight.shape[1:])
    q = w[:, :per_group].reshape(m.num_attention_heads * d, *weight.shape[1:])
    k = w[:, per_group].reshape(groups * d, *weight.shape[1:])
    v = w[:, per_group + 1].reshape(groups * d, *weight.shape[1:])
    return q, k, v


def _gpt2_layer(src: dict, dst: str, m: ModelConfig) -> dict:
    out = {}
    for kind in ("weight", "bias"):
        out[f"{dst}ln_1.{kind}"] = src.pop(f"input_layernorm.{kind}")
        out[f"{dst}ln_2.{kind}"] = src.pop(f"pre_mlp_layernorm.{kind}")
    q, k, v = _split_qkv(src.pop("self_attention.linear_qkv.weight"), m)
    out[dst + "attn.c_attn.weight"] = torch.cat([q, k, v]).t().contiguous()  # Conv1D: [in, out]
    out[dst + "attn.c_attn.bias"] = torch.cat(_split_qkv(src.pop("self_attention.linear_qkv.bias"), m))
    out[dst + "attn.c_proj.weight"] = src.pop("self_attention.linear_proj.weight").t().contiguous()
    out[dst + "attn.c_proj.bias"] = src.pop("self_attention.linear_proj.bias")
    out[dst + "mlp.c_fc.weight"] = src.pop("mlp.linear_fc1.weight").t().contiguous()
    out[dst + "mlp.c_fc.bias"] = src.pop("mlp.linear_fc1.bias")
    out[dst + "mlp.c_proj.weight"] = src.pop("mlp.linear_fc2.weight").t().contiguous()
    out[dst + "mlp.c_proj.bias"] = src.pop("mlp.linear_fc2.bias")
    return out


def _llama_layer(src: dict, dst: str, m: ModelConfig) -> dict:
    out = {dst + "input_layernorm.weight": src.pop("input_layernorm.weight")}
    out[dst + "post_attention_layernorm.weight"] = src.pop("pre_mlp_layernorm.weight")
    for kind in ("weight", "bias"):  # biases: qwen2 (q, k, v only) or add_bias_linear
        if f"self_attention.linear_qkv.{kind}" in src:
            q, k, v = _split_qkv(src.pop(f"self_attention.linear_qkv.{kind}"), m)
            out[f"{dst}self_attn.q_proj.{kind}"], out[f"{dst}self_attn.k_proj.{kind}"] = q, k
            out[f"{dst}self_attn.v_proj.{kind}"] = v
        if f"self_attention.linear_proj.{kind}" in src:
            out[f"{dst}self_attn.o_proj.{kind}"] = src.pop(f"self_attention.linear_proj.{kind}")
        if f"mlp.linear_fc1.{kind}" in src:
            gate, up = src.pop(f"mlp.linear_fc1.{kind}").chunk(2, dim=0)
            out[f"{dst}mlp.gate_proj.{kind}"], out[f"{dst}mlp.up_proj.{kind}"] = gate, up
        if f"mlp.linear_fc2.{kind}" in src:
            out[f"{dst}mlp.down_proj.{kind}"] = src.pop(f"mlp.linear_fc2.{kind}")
    return out


def layer_prefix(m: ModelConfig, i: int) -> str:
    return f"transformer.h.{i}." if m.family == "gpt2" else f"model.layers.{i}."


def megatron_layer_to_hf(layer: dict, i: int, m: ModelConfig) -> dict:
    """Transformer layer `i`'s megatron tensors (names without "decoder.layers.{i}.") -> its
    transformers tensors. A tensor with no place in the transformers model is an error."""
    src = {_CHECKPOINT_NAMES.get(k, k): v for k, v in layer.items() if not k.endswith("_extra_state")}
    try:
        out = (_gpt2_layer if m.family == "gpt2" else _llama_layer)(src, layer_prefix(m, i), m)
    except KeyError as missing:
        raise ValueError(f"layer {i} of the megatron weights has no {missing.args[0]} (model {m.name})") from None
    if src:
        raise ValueError(f"layer {i}: no transformers place for megatron tensors {sorted(src)} (model {m.name})")
    return out


def megatron_outer_to_hf(name: str, tensor: torch.Tensor, m: ModelConfig) -> dict:
    """One tensor outside the transformer layers -> {transformers name: tensor}; the output layer
    of a model with tied embeddings maps to nothing (transformers ties lm_head itself)."""
    gpt2 = m.family == "gpt2"
    if name == "embedding.word_embeddings.weight":
        return {"transformer.wte.weight" if gpt2 else "model.embed_tokens.weight": tensor[: m.vocab_size]}
    if name == "embedding.position_embeddings.weight" and gpt2:
        return {"transformer.wpe.weight": tensor}
    if name.startswith("decoder.final_layernorm."):
        return {("transformer.ln_f." if gpt2 else "model.norm.") + name.rsplit(".", 1)[1]: tensor}
    if name == "output_layer.weight":
        return {} if m.tie_embeddings else {"lm_head.weight": tensor[: m.vocab_size]}
    raise ValueError(f"no transformers place for megatron tensor {name} (model {m.name})")


def megatron_to_hf(state: dict, m: ModelConfig) -> dict:
    """A whole tp=1, pp=1 GPTModel state dict -> the transformers state dict (lm_head included
    also when tied: load_state_dict(strict=True) expects it)."""
    state = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    out: dict[str, torch.Tensor] = {}
    for i in range(m.num_layers):
        prefix = f"decoder.layers.{i}."
        out.update(megatron_layer_to_hf({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, i, m))
    for name, tensor in state.items():
        if not name.startswith("decoder.layers."):
            out.update(megatron_outer_to_hf(name, tensor, m))
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = state["embedding.word_embeddings.weight"][: m.vocab_size]
    return out
