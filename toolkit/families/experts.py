"""What the mixture-of-experts families share: their model.moe fields from config.json, and the
names of one MoE layer's tensors on disk (router, each expert's gate/up/down projections, shared
experts), which the families map to megatron-core's MoELayer (router.weight; per expert
linear_fc1 = [gate; up] and linear_fc2; shared_experts.linear_fc1/linear_fc2 and gate_weight)."""

from __future__ import annotations

from dataclasses import dataclass


def moe_fields(
    experts: int,
    topk: int,
    expert_ffn: int,
    norm_topk_prob: bool,
    aux_loss_coeff: float | None,
    dense_layers: list[int] | None = None,
    shared_expert_size: int | None = None,
    shared_expert_gate: bool = False,
) -> dict:
    """model.moe's fields (toolkit.config.schema.MoeConfig) of a transformers MoE config."""
    fields = {
        "num_experts": experts,
        "router_topk": topk,
        "norm_topk_prob": norm_topk_prob,
        "score_function": "softmax",
        "ffn_hidden_size": expert_ffn,
        "shared_expert_size": shared_expert_size,
        "shared_expert_gate": shared_expert_gate,
        "layer_freq": 1,
        "dense_layers": list(dense_layers or []),
        "load_balancing": "aux_loss",
    }
    if aux_loss_coeff is not None:
        fields["aux_loss_coeff"] = float(aux_loss_coeff)
    return fields


@dataclass(frozen=True)
class ExpertNames:
    """One MoE layer's tensor names on disk, after the layer's prefix (`model.layers.{i}.`)."""

    router: str  # [experts, hidden]
    expert: str  # expert e's prefix, with {e}
    gate: str  # the SwiGLU projections' module names under it
    up: str
    down: str
    shared: str | None = None  # the shared experts' prefix (gate_proj, up_proj, down_proj under it)
    shared_gate: str | None = None  # their sigmoid gate's weight, [1, hidden]
