"""What the mixture-of-experts families share: their model.moe fields from config.json, and the
names of one MoE layer's tensors on disk (router, each expert's gate/up/down projections), which
the families map to megatron-core's MoELayer (router.weight; per expert linear_fc1 = [gate; up]
and linear_fc2). Shared experts (Qwen2-MoE) have no family yet."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.config.schema import ModelConfig


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
class Unexpressed:
    """A model.moe setting an MoE family's transformers blocks cannot express."""

    value: object  # the configured value
    expressed: object  # the value they express
    why: str  # what the blocks do instead


def routing_unexpressed(m: ModelConfig) -> dict[str, Unexpressed]:
    """What transformers' Mixtral and Qwen MoE blocks (MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock)
    do not express: their router ranks a softmax of its logits with no bias, every expert takes all
    its tokens (dropless), and no expert is shared."""
    moe, out = m.moe, {}
    if moe.score_function != "softmax":
        out["model.moe.score_function"] = Unexpressed(moe.score_function, "softmax", "rank a softmax of the logits")
    if moe.load_balancing == "expert_bias":
        out["model.moe.load_balancing"] = Unexpressed(moe.load_balancing, "aux_loss", "add no bias to the scores")
    if moe.capacity_factor is not None:
        out["model.moe.capacity_factor"] = Unexpressed(moe.capacity_factor, None, "drop no token")
    if moe.shared_expert_size:
        out["model.moe.shared_expert_size"] = Unexpressed(moe.shared_expert_size, None, "share no expert")
    return out


def every_layer_unexpressed(m: ModelConfig) -> dict[str, Unexpressed]:
    """What a family whose every layer is an MoE layer (Mixtral) does not express."""
    why, out = "make every layer an MoE layer", {}
    if m.moe.layer_freq != 1:
        out["model.moe.layer_freq"] = Unexpressed(m.moe.layer_freq, 1, why)
    if m.moe.dense_layers:
        out["model.moe.dense_layers"] = Unexpressed(list(m.moe.dense_layers), [], why)
    return out


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


def unfused_on_disk(name: str, tensor, names: ExpertNames) -> dict:
    """One tensor of transformers' model in memory -> the family's tensors on disk: the fused
    experts split expert by expert (the inverse of fused_in_memory, one tensor at a time)."""
    prefix, found = next(((name[: -len(n)], n) for n in (ROUTER, GATE_UP, DOWN) if name.endswith(n)), (name, None))
    if found is None:
        return {name: tensor}
    if found == ROUTER:
        return {prefix + names.router: tensor}
    out = {}
    for e, expert in enumerate(tensor):
        base = f"{prefix}{names.expert.format(e=e)}"
        if found == GATE_UP:
            out[f"{base}{names.gate}.weight"], out[f"{base}{names.up}.weight"] = expert.chunk(2, dim=0)
        else:
            out[f"{base}{names.down}.weight"] = expert
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
