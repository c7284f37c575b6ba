"""Qwen3 and Qwen3-MoE (transformers' modeling_qwen3.py, modeling_qwen3_moe.py; Qwen Team 2025,
"Qwen3 Technical Report", section 2): Llama's layers with an RMSNorm over each head's queries and
keys (`self_attn.q_norm`, `k_norm`: megatron-core's qk_layernorm) and no q/k/v biases. Qwen3-MoE
replaces the MLPs by `num_experts` experts of `moe_intermediate_size` under `mlp.experts.{e}.`
(gate_proj, up_proj, down_proj on disk) and a router `mlp.gate`; the top-k weights are
renormalised when norm_topk_prob (Qwen3's models: true). Layer i is sparse when it is not in
mlp_only_layers and (i + 1) % decoder_sparse_step == 0; the dense ones have the dense MLP.
"""

from __future__ import annotations

from toolkit.config.schema import ModelConfig
from toolkit.families.experts import ExpertNames, moe_fields, qwen_dense_layers, qwen_moe_config, routing_unexpressed
from toolkit.families.llama import LlamaLike


class Qwen3(LlamaLike):
    qk_layernorm = True

    def _variant(self, c: dict, attention_bias: bool, window, path) -> dict:
        window = window if c.get("use_sliding_window", False) else None
        return {"add_bias_linear": False, "add_qkv_bias": attention_bias, "sliding_window": window}

    def _config(self, common: dict, m: ModelConfig):
        from transformers import Qwen3Config

        return Qwen3Config(**common, attention_bias=m.add_qkv_bias, use_sliding_window=False)


class Qwen3Moe(Qwen3):
    experts = ExpertNames(
        router="mlp.gate.weight", expert="mlp.experts.{e}.", gate="gate_proj", up="up_proj", down="down_proj"
    )

    def _variant(self, c: dict, attention_bias: bool, window, path) -> dict:
        moe = moe_fields(
            c.get("num_local_experts", c.get("num_experts", 128)),  # saved under its attribute_map name
            c.get("num_experts_per_tok", 8),
            c["moe_intermediate_size"],
            bool(c.get("norm_topk_prob", False)),
            c.get("router_aux_loss_coef"),
            qwen_dense_layers(c),
        )
        return {**super()._variant(c, attention_bias, window, path), "moe": moe}

    def unexpressed(self, m: ModelConfig) -> dict:
        return routing_unexpressed(m)

    def _config(self, common: dict, m: ModelConfig):
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**common, **qwen_moe_config(m), attention_bias=m.add_qkv_bias, use_sliding_window=False)


QWEN3, QWEN3_MOE = Qwen3("qwen3"), Qwen3Moe("qwen3_moe")
