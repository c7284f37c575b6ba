"""GPT-2 (transformers' modeling_gpt2.py): LayerNorm with biases, GeLU, learned absolute
positions; per layer one c_attn of [all q; all k; all v], c_proj, and the MLP's c_fc and c_proj,
all Conv1D, which stores weights [in, out] (transposed to torch.nn.Linear's [out, in]), under
`transformer.h.{i}.`.
"""

from __future__ import annotations

from toolkit.config.schema import ModelConfig
from toolkit.families.base import Family, PipelineParts
from toolkit.families.qkv import interleave_qkv, split_qkv
from toolkit.formats.hf_arch import NO_SCALING, unsupported

# GPT2Config.activation_function -> parakit's activation: gelu_new is the tanh approximation
# (transformers/activations.py NewGELUActivation), gelu the exact erf form.
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# megatron-core's Conv1D-shaped tensors of a layer -> GPT-2's module names
_CONV1D = {
    "self_attention.linear_proj.": "attn.c_proj.",
    "mlp.linear_fc1.": "mlp.c_fc.",
    "mlp.linear_fc2.": "mlp.c_proj.",
}


class Gpt2(Family):
    name = "gpt2"
    default_vocab_size = 50257
    layers_prefix = "transformer.h"
    embedding_name = "transformer.wte.weight"
    positions_name = "transformer.wpe.weight"
    final_norm = "transformer.ln_f."
    norm_bias = True

    def fields(self, c: dict, path) -> dict:
        act = c.get("activation_function", "gelu_new")
        if act not in _ACTIVATIONS:
            raise unsupported(path, f"activation_function={act!r}")
        if c.get("scale_attn_by_inverse_layer_idx") or c.get("reorder_and_upcast_attn"):
            raise unsupported(path, "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn")
        if not c.get("scale_attn_weights", True):
            raise unsupported(path, "scale_attn_weights=false")
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
            "activation": _ACTIVATIONS[act],
            "position_embedding": "learned_absolute",
            "rotary_base": 10000.0,
            "rope_scaling": dict(NO_SCALING),
            "add_bias_linear": True,
            "add_qkv_bias": True,
            "sliding_window": None,
            "hidden_dropout": float(c.get("resid_pdrop", 0.1)),
            "attention_dropout": float(c.get("attn_pdrop", 0.1)),
        }

    def hf_config(self, m: ModelConfig):
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=m.vocab_size,
            n_positions=m.max_position_embeddings,
            n_embd=m.hidden_size,
            n_layer=m.num_layers,
            n_head=m.num_attention_heads,
            n_inner=m.ffn_hidden_size,
            layer_norm_epsilon=m.norm_epsilon,
            resid_pdrop=m.hidden_dropout,
            embd_pdrop=m.hidden_dropout,
            attn_pdrop=m.attention_dropout,
            initializer_range=m.init_method_std,
            tie_word_embeddings=m.tie_embeddings,
            # exact (erf) GeLU as megatron-core's F.gelu, or GPT-2's own tanh approximation
            activation_function="gelu_new" if m.activation == "gelu_tanh" else "gelu",
        )

    def layer_to_hf(self, src: dict, i: int, m: ModelConfig) -> dict:
        import torch

        dst = self.layer_prefix(i)
        out = {}
        for kind in ("weight", "bias"):
            out[f"{dst}ln_1.{kind}"] = src.pop(f"input_layernorm.{kind}")
            out[f"{dst}ln_2.{kind}"] = src.pop(f"pre_mlp_layernorm.{kind}")
        q, k, v = split_qkv(src.pop("self_attention.linear_qkv.weight"), m)
        out[dst + "attn.c_attn.weight"] = torch.cat([q, k, v]).t().contiguous()  # Conv1D: [in, out]
        out[dst + "attn.c_attn.bias"] = torch.cat(split_qkv(src.pop("self_attention.linear_qkv.bias"), m))
        for ours, theirs in _CONV1D.items():
            out[f"{dst}{theirs}weight"] = src.pop(f"{ours}weight").t().contiguous()
            out[f"{dst}{theirs}bias"] = src.pop(f"{ours}bias")
        return out

    def megatron_tensor(self, key: str, layer: int | None, hf, m: ModelConfig, expert: int | None = None):
        p = self.layer_prefix(layer) if layer is not None else ""
        kind = key.rsplit(".", 1)[-1]
        norm = "weight" if kind.endswith("weight") else "bias"  # layer_norm_weight / layer_norm_bias
        simple = {
            "embedding.position_embeddings.weight": self.positions_name,
            "decoder.final_layernorm.weight": self.final_norm + "weight",
            "decoder.final_layernorm.bias": self.final_norm + "bias",
            f"decoder.layers.self_attention.linear_qkv.layer_norm_{norm}": f"{p}ln_1.{norm}",
            f"decoder.layers.mlp.linear_fc1.layer_norm_{norm}": f"{p}ln_2.{norm}",
        }
        if key in simple:
            return hf.get(simple[key])
        for ours, theirs in _CONV1D.items():
            if key.startswith("decoder.layers." + ours):
                t = hf.get(f"{p}{theirs}{kind}")
                return t.t().contiguous() if kind == "weight" else t
        if key.startswith("decoder.layers.self_attention.linear_qkv."):
            t = hf.get(f"{p}attn.c_attn.{kind}")
            t = t.t() if kind == "weight" else t  # [3 * hidden, hidden]: all q, all k, all v
            return interleave_qkv(*t.chunk(3, dim=0), m)
        return None

    def pipeline_parts(self, model) -> PipelineParts:
        body = model.transformer
        return PipelineParts(body.wte, body.wpe, list(body.h), None, body.ln_f, model.lm_head)


GPT2 = Gpt2()
