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


# transformers' in-memory names of an MoE layer (its modules after from_pretrained: the experts fused
# into [experts, 2 x ffn, hidden] gate-and-up and [experts, hidden, ffn] down tensors,
# integrations/moe.py and conversion_mapping.py), the same for Mixtral and the Qwen MoE families
ROUTER, GATE_UP, DOWN = "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def experts_to_hf(src: dict, prefix: str) -> dict:
    """One MoE layer's megatron tensors (router.weight; local_experts.{e}.linear_fc1 = [gate; up]
    and linear_fc2, all experts of a tp=1 model) -> transformers' fused in-memory tensors; each
    tensor used is popped from `src`."""
    import torch

    if "mlp.router.weight" not in src:
        return {}
    experts = sorted(
        {int(k.split(".")[3]) for k in src if k.startswith("mlp.experts.local_experts.")},
    )
    fc1 = [src.pop(f"mlp.experts.local_experts.{e}.linear_fc1.weight") for e in experts]
    fc2 = [src.pop(f"mlp.experts.local_experts.{e}.linear_fc2.weight") for e in experts]
    return {
        prefix + ROUTER: src.pop("mlp.router.weight"),
        prefix + GATE_UP: torch.stack(fc1),
        prefix + DOWN: torch.stack(fc2),
    }


def expert_tensor(names: ExpertNames, key: str, prefix: str, expert: int | None, hf):
    """The global megatron tensor of an MoE layer's checkpoint key from the tensors on disk: the
    router, or expert `expert`'s fc1 ([gate; up]) or fc2; None for another key."""
    import torch

    if key == "decoder.layers.mlp.router.weight":
        return hf.get(prefix + names.router)
    if expert is None or ".mlp.experts." not in key:
        return None
    base = prefix + names.expert.format(e=expert)
    if key.endswith("linear_fc1.weight"):
        return torch.cat([hf.get(f"{base}{names.gate}.weight"), hf.get(f"{base}{names.up}.weight")])
    if key.endswith("linear_fc2.weight"):
        return hf.get(f"{base}{names.down}.weight")
    return None
