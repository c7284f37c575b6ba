"""What the mixture-of-experts families share: their model.moe fields from config.json, and the
names of one MoE layer's tensors on disk (router, each expert's gate/up/down projections), which
the families map to megatron-core's MoELayer (router.weight; per expert linear_fc1 = [gate; up]
and linear_fc2). Shared experts (Qwen2-MoE) have no family yet."""

from __future__ import annotations

from dataclasses import dataclass


def moe_fields(
    experts: int, topk: int, expert_ffn: int, norm_topk_prob: bool, aux_loss_coeff: float | None, dense_layers=()
) -> dict:
    """model.moe's fields (toolkit.config.schema.MoeConfig) that a transformers MoE config gives;
    the others keep the schema's defaults (toolkit.families.hf_config.model_fields)."""
    fields = {
        "num_experts": experts,
        "router_topk": topk,
        "norm_topk_prob": norm_topk_prob,
        "ffn_hidden_size": expert_ffn,
        "dense_layers": list(dense_layers),
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


# transformers' in-memory names of an MoE layer (its modules after from_pretrained: the experts fused
# into [experts, 2 x ffn, hidden] gate-and-up and [experts, hidden, ffn] down tensors,
# integrations/moe.py and conversion_mapping.py), the same for Mixtral and the Qwen MoE families
ROUTER, GATE_UP, DOWN = "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def experts_to_hf(src: dict, prefix: str, names: ExpertNames) -> dict:
    """One MoE layer's megatron tensors (router.weight; local_experts.{e}.linear_fc1 = [gate; up]
    and linear_fc2, all experts of a tp=1 model) -> the family's tensors on disk, expert by expert
    (as its published checkpoints and save_pretrained write them); each tensor used is popped."""
    if "mlp.router.weight" not in src:
        return {}
    out = {prefix + names.router: src.pop("mlp.router.weight")}
    experts = sorted({int(k.split(".")[3]) for k in src if k.startswith("mlp.experts.local_experts.")})
    for e in experts:
        base = prefix + names.expert.format(e=e)
        gate, up = src.pop(f"mlp.experts.local_experts.{e}.linear_fc1.weight").chunk(2, dim=0)
        out[f"{base}{names.gate}.weight"], out[f"{base}{names.up}.weight"] = gate, up
        out[f"{base}{names.down}.weight"] = src.pop(f"mlp.experts.local_experts.{e}.linear_fc2.weight")
    return out


def names_on_disk(names: set[str], experts: ExpertNames, num_experts: int) -> set[str]:
    """The tensor names of the family's files for a model whose modules have `names` (the fused
    in-memory experts replaced by the per-expert tensors they are saved as)."""
    out = set()
    for name in names:
        prefix, found = next(((name[: -len(n)], n) for n in (ROUTER, GATE_UP, DOWN) if name.endswith(n)), (name, None))
        if found == ROUTER:
            out.add(prefix + experts.router)
        elif found is not None:
            kinds = (experts.gate, experts.up) if found == GATE_UP else (experts.down,)
            out |= {f"{prefix}{experts.expert.format(e=e)}{k}.weight" for e in range(num_experts) for k in kinds}
        else:
            out.add(name)
    return out


def fused_in_memory(state: dict, names: ExpertNames, layer_prefixes: list[str]) -> dict:
    """A whole state dict with the experts on disk's names -> transformers' in-memory names (what
    load_state_dict of the model wants): each layer's experts stacked into the fused tensors."""
    import torch

    state = dict(state)
    for prefix in layer_prefixes:
        if prefix + names.router not in state:
            continue  # a dense layer
        state[prefix + ROUTER] = state.pop(prefix + names.router)
        gate_up, down, e = [], [], 0
        while f"{prefix}{names.expert.format(e=e)}{names.gate}.weight" in state:
            base = prefix + names.expert.format(e=e)
            gate, up = state.pop(f"{base}{names.gate}.weight"), state.pop(f"{base}{names.up}.weight")
            gate_up.append(torch.cat([gate, up]))
            down.append(state.pop(f"{base}{names.down}.weight"))
            e += 1
        state[prefix + GATE_UP], state[prefix + DOWN] = torch.stack(gate_up), torch.stack(down)
    return state


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
