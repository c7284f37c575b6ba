"""The Llama family and its close relatives Qwen2 and Mistral (transformers' modeling_llama.py,
modeling_qwen2.py, modeling_mistral.py): RMSNorm, SwiGLU, RoPE; per layer q/k/v/o projections
and gate/up/down projections under `model.layers.{i}.`. Qwen2 has biases on q, k and v; Mistral
(and Qwen2 with use_sliding_window) attends to a sliding window.
"""

from __future__ import annotations

from toolkit.config.schema import ModelConfig
from toolkit.families.base import Family, PipelineParts
from toolkit.families.experts import expert_tensor, experts_to_hf
from toolkit.families.qkv import interleave_qkv, split_qkv
from toolkit.formats.hf_arch import rope_fields, unsupported


def rope_parameters(m: ModelConfig) -> dict:
    """transformers' `rope_parameters` (v5; config.json's rope_theta + rope_scaling in v4): the keys
    `modeling_rope_utils._validate_llama3_rope_parameters` requires for llama3."""
    params = {"rope_type": "default", "rope_theta": m.rotary_base}
    rs = m.rope_scaling
    if rs.type == "llama3":
        params.update(
            rope_type="llama3",
            factor=rs.factor,
            low_freq_factor=rs.low_freq_factor,
            high_freq_factor=rs.high_freq_factor,
            original_max_position_embeddings=rs.original_max_position_embeddings,
        )
    return params


# megatron-core's QK layernorm (local spec names) -> transformers' (Qwen3)
_QK_NORMS = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}


class LlamaLike(Family):
    default_vocab_size = 32000
    layers_prefix = "model.layers"
    embedding_name = "model.embed_tokens.weight"
    final_norm = "model.norm."

    def __init__(self, name: str):
        self.name = name

    # --- config.json in, transformers config out
    def _variant(self, c: dict, attention_bias: bool, window, path) -> dict:
        """The fields this variant sets its own way: biases and the sliding window."""
        raise NotImplementedError

    def fields(self, c: dict, path) -> dict:
        if c.get("hidden_act", "silu") != "silu":
            raise unsupported(path, f"hidden_act={c['hidden_act']!r} (SwiGLU needs silu)")
        heads = c["num_attention_heads"]
        variant = self._variant(c, bool(c.get("attention_bias", False)), c.get("sliding_window"), path)
        theta, scaling = rope_fields(c, path)
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
            **variant,
            "hidden_dropout": 0.0,
            "attention_dropout": float(c.get("attention_dropout", 0.0)),
        }

    def _config(self, common: dict, m: ModelConfig):
        raise NotImplementedError

    def hf_config(self, m: ModelConfig):
        return self._config(
            dict(
                vocab_size=m.vocab_size,
                hidden_size=m.hidden_size,
                intermediate_size=m.ffn_hidden_size,
                num_hidden_layers=m.num_layers,
                num_attention_heads=m.num_attention_heads,
                num_key_value_heads=m.num_kv_heads or m.num_attention_heads,
                head_dim=m.head_dim or m.hidden_size // m.num_attention_heads,
                max_position_embeddings=m.max_position_embeddings,
                rms_norm_eps=m.norm_epsilon,
                rope_parameters=rope_parameters(m),
                attention_dropout=m.attention_dropout,
                initializer_range=m.init_method_std,
                tie_word_embeddings=m.tie_embeddings,
            ),
            m,
        )

    # --- weights
    def layer_to_hf(self, src: dict, i: int, m: ModelConfig) -> dict:
        dst = self.layer_prefix(i)
        out = {dst + "input_layernorm.weight": src.pop("input_layernorm.weight")}
        out[dst + "post_attention_layernorm.weight"] = src.pop("pre_mlp_layernorm.weight")
        for ours, theirs in _QK_NORMS.items() if self.qk_layernorm else ():  # Qwen3: per-head q and k norms
            out[dst + theirs] = src.pop(ours)
        if self.experts is not None:
            out.update(experts_to_hf(src, dst, self.experts))
        for kind in ("weight", "bias"):  # biases: qwen2 (q, k, v only) or add_bias_linear
            if f"self_attention.linear_qkv.{kind}" in src:
                q, k, v = split_qkv(src.pop(f"self_attention.linear_qkv.{kind}"), m)
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

    def megatron_tensor(self, key: str, layer: int | None, hf, m: ModelConfig, expert: int | None = None):
        import torch

        p = self.layer_prefix(layer) if layer is not None else ""
        kind = key.rsplit(".", 1)[-1]  # weight | bias | layer_norm_weight
        simple = {
            "decoder.final_layernorm.weight": self.final_norm + "weight",
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight": p + "input_layernorm.weight",
            "decoder.layers.mlp.linear_fc1.layer_norm_weight": p + "post_attention_layernorm.weight",
            "decoder.layers.self_attention.linear_proj.weight": p + "self_attn.o_proj.weight",
            "decoder.layers.self_attention.linear_proj.bias": p + "self_attn.o_proj.bias",
            "decoder.layers.mlp.linear_fc2.weight": p + "mlp.down_proj.weight",
            "decoder.layers.mlp.linear_fc2.bias": p + "mlp.down_proj.bias",
        }
        if self.qk_layernorm:
            simple.update({f"decoder.layers.{ours}": p + theirs for ours, theirs in _QK_NORMS.items()})
        if key in simple:
            return hf.get(simple[key])
        if self.experts is not None and (found := expert_tensor(self.experts, key, p, expert, hf)) is not None:
            return found
        if key.startswith("decoder.layers.self_attention.linear_qkv."):
            q, k, v = (hf.get(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv")
            return interleave_qkv(q, k, v, m)
        if key.startswith("decoder.layers.mlp.linear_fc1."):
            return torch.cat([hf.get(f"{p}mlp.gate_proj.{kind}"), hf.get(f"{p}mlp.up_proj.{kind}")])
        return None

    def pipeline_parts(self, model) -> PipelineParts:
        body = model.model
        return PipelineParts(body.embed_tokens, None, list(body.layers), body.rotary_emb, body.norm, model.lm_head)


class Llama(LlamaLike):
    def _variant(self, c: dict, attention_bias: bool, window, path) -> dict:
        if attention_bias != bool(c.get("mlp_bias", False)):
            # megatron-core's add_bias_linear covers the attention output and both MLP projections.
            raise unsupported(path, f"attention_bias={attention_bias} with mlp_bias={bool(c.get('mlp_bias', False))}")
        return {"add_bias_linear": attention_bias, "add_qkv_bias": attention_bias, "sliding_window": None}

    def _config(self, common: dict, m: ModelConfig):
        from transformers import LlamaConfig

        return LlamaConfig(**common, attention_bias=m.add_bias_linear, mlp_bias=m.add_bias_linear)


class Qwen2(LlamaLike):
    def _variant(self, c: dict, attention_bias: bool, window, path) -> dict:
        # Qwen2 keeps a sliding_window value that only use_sliding_window turns on
        window = window if c.get("use_sliding_window", False) else None
        return {"add_bias_linear": False, "add_qkv_bias": True, "sliding_window": window}

    def _config(self, common: dict, m: ModelConfig):  # biases on q, k, v only
        from transformers import Qwen2Config

        return Qwen2Config(**common, use_sliding_window=False)


class Mistral(LlamaLike):
    def _variant(self, c: dict, attention_bias: bool, window, path) -> dict:
        return {"add_bias_linear": False, "add_qkv_bias": attention_bias, "sliding_window": window}

    def _config(self, common: dict, m: ModelConfig):
        from transformers import MistralConfig

        return MistralConfig(**common, sliding_window=m.sliding_window)


LLAMA, QWEN2, MISTRAL = Llama("llama"), Qwen2("qwen2"), Mistral("mistral")
