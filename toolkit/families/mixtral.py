"""Mixtral (transformers' modeling_mixtral.py; Jiang et al. 2024, "Mixtral of Experts"): Mistral's
attention with every MLP replaced by `num_local_experts` SwiGLU experts and a router
(`block_sparse_moe.gate`, no bias) that sends each token to `num_experts_per_tok` of them: the
top-k of the router's softmax, renormalised to sum to 1. On disk (safetensors, as the published
checkpoints and transformers' save_pretrained write them) each expert is
`block_sparse_moe.experts.{e}.w1` (gate), `w3` (up) and `w2` (down); transformers fuses them into
[experts, ...] tensors in memory only (conversion_mapping.py).
"""

from __future__ import annotations

from toolkit.config.schema import ModelConfig, expert_ffn_size
from toolkit.families.experts import ExpertNames, Unexpressed, every_layer_unexpressed, moe_fields, routing_unexpressed
from toolkit.families.llama import LlamaLike
from toolkit.formats.hf_arch import unsupported


class Mixtral(LlamaLike):
    experts = ExpertNames(
        router="block_sparse_moe.gate.weight",
        expert="block_sparse_moe.experts.{e}.",
        gate="w1",
        up="w3",
        down="w2",
    )

    def _variant(self, c: dict, attention_bias: bool, window, path) -> dict:
        if float(c.get("router_jitter_noise", 0.0)):
            raise unsupported(
                path, f"router_jitter_noise={c['router_jitter_noise']} (megatron-core's router adds none)"
            )
        experts = c.get("num_local_experts", 8)
        return {
            "add_bias_linear": False,
            "add_qkv_bias": False,
            "sliding_window": window,
            "moe": moe_fields(
                experts, c.get("num_experts_per_tok", 2), c["intermediate_size"], True, c.get("router_aux_loss_coef")
            ),
        }

    def unexpressed(self, m: ModelConfig) -> dict:
        out = {**routing_unexpressed(m), **every_layer_unexpressed(m)}
        if not m.moe.norm_topk_prob:
            out["model.moe.norm_topk_prob"] = Unexpressed(False, True, "renormalise the top-k weights")
        return out

    def _config(self, common: dict, m: ModelConfig):
        from transformers import MixtralConfig

        return MixtralConfig(
            **{**common, "intermediate_size": expert_ffn_size(m)},
            num_local_experts=m.moe.num_experts,
            num_experts_per_tok=m.moe.router_topk,
            router_aux_loss_coef=m.moe.aux_loss_coeff,
            sliding_window=m.sliding_window,
        )


MIXTRAL = Mixtral("mixtral")
