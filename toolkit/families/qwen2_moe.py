"""Qwen2-MoE (transformers' modeling_qwen2_moe.py; Qwen Team 2024, "Qwen2 Technical Report",
section 2.2.3): Qwen2's attention (biases on q, k and v) with the MLPs replaced by `num_experts`
experts of `moe_intermediate_size` under `mlp.experts.{e}.` (gate_proj, up_proj, down_proj on
disk), a router `mlp.gate` whose softmax's top-k weights are kept as they are (norm_topk_prob:
false in its models; megatron-core's moe_router_pre_softmax), and a shared expert
(`mlp.shared_expert.*` of shared_expert_intermediate_size) that every token passes through,
scaled by a sigmoid gate (`mlp.shared_expert_gate`, [1, hidden]): megatron-core's shared experts
with moe_shared_expert_gate. Layer i is sparse when it is not in mlp_only_layers and
(i + 1) % decoder_sparse_step == 0, as in Qwen3-MoE.
"""

from __future__ import annotations

from toolkit.config.schema import ModelConfig
from toolkit.families.experts import ExpertNames, moe_fields, qwen_dense_layers, qwen_moe_config, routing_unexpressed
from toolkit.families.llama import Qwen2
from toolkit.formats.hf_arch import unsupported


class Qwen2Moe(Qwen2):
    experts = ExpertNames(
        router="mlp.gate.weight",
        expert="mlp.experts.{e}.",
        gate="gate_proj",
        up="up_proj",
        down="down_proj",
        shared="mlp.shared_expert.",
        shared_gate="mlp.shared_expert_gate.weight",
    )

    def _variant(self, c: dict, attention_bias: bool, window, path) -> dict:
        shared = c.get("shared_expert_intermediate_size", 5632)  # Qwen2MoeConfig's default
        if not shared:
            raise unsupported(path, "shared_expert_intermediate_size=0 (parakit's Qwen2-MoE has a shared expert)")
        moe = moe_fields(
            c.get("num_experts", 60),
            c.get("num_experts_per_tok", 4),
            c["moe_intermediate_size"],
            bool(c.get("norm_topk_prob", False)),
            c.get("router_aux_loss_coef"),
            qwen_dense_layers(c),
            shared,
        )
        variant = super()._variant(c, attention_bias, window, path)
        return {**variant, "add_qkv_bias": bool(c.get("qkv_bias", True)), "moe": moe}

    def unexpressed(self, m: ModelConfig) -> dict:
        return routing_unexpressed(m, gated_shared_expert=True)

    def _config(self, common: dict, m: ModelConfig):
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(
            **common,
            **qwen_moe_config(m),
            qkv_bias=m.add_qkv_bias,
            use_sliding_window=False,
            shared_expert_intermediate_size=m.moe.shared_expert_size,
        )


QWEN2_MOE = Qwen2Moe("qwen2_moe")
