"""megatron-core GPTModel weights (tp=1, pp=1 state dict, local layer spec names) -> the
transformers model of the same config (Llama- or GPT-2-style).

megatron-core fuses Q, K and V into one linear_qkv whose rows are grouped by KV group:
[q heads of group 0, k of group 0, v of group 0, q heads of group 1, ...]; transformers keeps
q_proj/k_proj/v_proj (Llama) or one c_attn of [all q, all k, all v] stored transposed (GPT-2's
Conv1D). SwiGLU's linear_fc1 holds [gate; up]. The padded vocabulary rows are dropped.
"""

from __future__ import annotations

import torch

from toolkit.config.schema import ModelConfig
from toolkit.plan.params import head_dim, kv_heads


def _split_qkv(weight: torch.Tensor, m: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = kv_heads(m), head_dim(m)
    per_group = m.num_attention_heads // groups
    w = weight.reshape(groups, per_group + 2, d, *weight.shape[1:])
    q = w[:, :per_group].reshape(m.num_attention_heads * d, *weight.shape[1:])
    k = w[:, per_group].reshape(groups * d, *weight.shape[1:])
    v = w[:, per_group + 1].reshape(groups * d, *weight.shape[1:])
    return q, k, v


def megatron_to_hf(state: dict, m: ModelConfig) -> dict:
    state = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    vocab = m.vocab_size
    out: dict[str, torch.Tensor] = {}
    if m.family == "gpt2":
        out["transformer.wte.weight"] = state["embedding.word_embeddings.weight"][:vocab]
        out["transformer.wpe.weight"] = state["embedding.position_embeddings.weight"]
        for i in range(m.num_layers):
            src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
            out[dst + "ln_1.weight"], out[dst + "ln_1.bias"] = (
                state[src + "input_layernorm.weight"],
                state[src + "input_layernorm.bias"],
            )
            out[dst + "ln_2.weight"], out[dst + "ln_2.bias"] = (
                state[src + "pre_mlp_layernorm.weight"],
                state[src + "pre_mlp_layernorm.bias"],
            )
            q, k, v = _split_qkv(state[src + "self_attention.linear_qkv.weight"], m)
            out[dst + "attn.c_attn.weight"] = torch.cat([q, k, v]).t().contiguous()  # Conv1D: [in, out]
            qb, kb, vb = _split_qkv(state[src + "self_attention.linear_qkv.bias"], m)
            out[dst + "attn.c_attn.bias"] = torch.cat([qb, kb, vb])
            out[dst + "attn.c_proj.weight"] = state[src + "self_attention.linear_proj.weight"].t().contiguous()
            out[dst + "attn.c_proj.bias"] = state[src + "self_attention.linear_proj.bias"]
            out[dst + "mlp.c_fc.weight"] = state[src + "mlp.linear_fc1.weight"].t().contiguous()
            out[dst + "mlp.c_fc.bias"] = state[src + "mlp.linear_fc1.bias"]
            out[dst + "mlp.c_proj.weight"] = state[src + "mlp.linear_fc2.weight"].t().contiguous()
            out[dst + "mlp.c_proj.bias"] = state[src + "mlp.linear_fc2.bias"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = (
            state["decoder.final_layernorm.weight"],
            state["decoder.final_layernorm.bias"],
        )
        out["lm_head.weight"] = state.get("output_layer.weight", state["embedding.word_embeddings.weight"])[:vocab]
        return out
    out["model.embed_tokens.weight"] = state["embedding.word_embeddings.weight"][:vocab]
    for i in range(m.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "pre_mlp_layernorm.weight"]
        q, k, v = _split_qkv(state[src + "self_attention.linear_qkv.weight"], m)
        (
            out[dst + "self_attn.q_proj.weight"],
            out[dst + "self_attn.k_proj.weight"],
            out[dst + "self_attn.v_proj.weight"],
        ) = q, k, v
        out[dst + "self_attn.o_proj.weight"] = state[src + "self_attention.linear_proj.weight"]
        gate, up = state[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
        out[dst + "mlp.down_proj.weight"] = state[src + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = state.get("output_layer.weight", state["embedding.word_embeddings.weight"])[:vocab]
    return out
