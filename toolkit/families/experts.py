"""What the mixture-of-experts families share: their model.moe fields from config.json, and the
names of one MoE layer's tensors on disk (router, each expert's gate/up/down projections, a shared
expert and its gate), which the families map to megatron-core's MoELayer (router.weight; per expert
linear_fc1 = [gate; up] and linear_fc2; shared_experts.linear_fc1, linear_fc2 and gate_weight)."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.config.schema import ModelConfig, expert_ffn_size, moe_layer_pattern


def moe_fields(
    experts: int,
    topk: int,
    expert_ffn: int,
    norm_topk_prob: bool,
    aux_loss_coeff: float | None,
    dense_layers=(),
    shared_expert_size: int | None = None,
) -> dict:
    """model.moe's fields (toolkit.config.schema.MoeConfig) that a transformers MoE config gives;
    the others keep the schema's defaults (toolkit.families.hf_config.model_fields). A shared expert
    is gated (Qwen2-MoE's sigmoid gate)."""
    fields = {
        "num_experts": experts,
        "router_topk": topk,
        "norm_topk_prob": norm_topk_prob,
        "ffn_hidden_size": expert_ffn,
        "dense_layers": list(dense_layers),
    }
    if shared_expert_size:
        fields |= {"shared_expert_size": shared_expert_size, "shared_expert_gate": True}
    if aux_loss_coeff is not None:
        fields["aux_loss_coeff"] = float(aux_loss_coeff)
    return fields


def qwen_dense_layers(c: dict) -> list[int]:
    """The dense layers of a Qwen MoE config.json (Qwen2-MoE, Qwen3-MoE): those in mlp_only_layers
    and those off every decoder_sparse_step-th (layer i is sparse when (i + 1) % step == 0)."""
    only_dense, step = set(c.get("mlp_only_layers") or []), c.get("decoder_sparse_step", 1)
    return [i for i in range(c["num_hidden_layers"]) if i in only_dense or (i + 1) % step]


def qwen_moe_config(m: ModelConfig) -> dict:
    """The experts' fields of a Qwen MoE transformers config (Qwen2MoeConfig, Qwen3MoeConfig), every
    dense layer listed in mlp_only_layers with decoder_sparse_step 1: any of megatron-core's layer
    patterns."""
    return dict(
        num_experts=m.moe.num_experts,
        num_experts_per_tok=m.moe.router_topk,
        moe_intermediate_size=expert_ffn_size(m),
        norm_topk_prob=m.moe.norm_topk_prob,
        router_aux_loss_coef=m.moe.aux_loss_coeff,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, sparse in enumerate(moe_layer_pattern(m)) if not sparse],
    )


@dataclass(frozen=True)
class Unexpressed:
    """A model.moe setting an MoE family's transformers blocks cannot express."""

    value: object  # the configured value
    expressed: object  # the value they express
    why: str  # what the blocks do instead


def routing_unexpressed(m: ModelConfig, gated_shared_expert: bool = False) -> dict[str, Unexpressed]:
    """What transformers' Mixtral and Qwen MoE blocks (MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock,
    Qwen2MoeSparseMoeBlock) do not express: their router ranks a softmax of its logits with no
    bias, every expert takes all its tokens (dropless), and no expert is shared -- or, for
    `gated_shared_expert` (Qwen2-MoE), one always is, behind a sigmoid gate."""
    moe, out = m.moe, {}
    if moe.score_function != "softmax":
        out["model.moe.score_function"] = Unexpressed(moe.score_function, "softmax", "rank a softmax of the logits")
    if moe.load_balancing == "expert_bias":
        out["model.moe.load_balancing"] = Unexpressed(moe.load_balancing, "aux_loss", "add no bias to the scores")
    if moe.capacity_factor is not None:
        out["model.moe.capacity_factor"] = Unexpressed(moe.capacity_factor, None, "drop no token")
    if gated_shared_expert:
        if not moe.shared_expert_size:
            out["model.moe.shared_expert_size"] = Unexpressed(None, "N", "always share an expert (of N FFN columns)")
        if not moe.shared_expert_gate:
            out["model.moe.shared_expert_gate"] = Unexpressed(False, True, "gate the shared expert (sigmoid)")
    elif moe.shared_expert_size:
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
    gate: str  # the SwiGLU projections' module names under it (and under `shared`)
    up: str
    down: str
    shared: str | None = None  # the shared expert's prefix (Qwen2-MoE); None: no shared expert
    shared_gate: str | None = None  # its gate's weight, [1, hidden]

    def shared_names(self, prefix: str) -> dict[str, str]:
        """megatron-core's shared-expert names (local spec, in a layer) -> the family's on disk;
        linear_fc1 is [gate; up]."""
        if self.shared is None:
            return {}
        return {
            "mlp.shared_experts.linear_fc2.weight": f"{prefix}{self.shared}{self.down}.weight",
            "mlp.shared_experts.gate_weight": prefix + self.shared_gate,
        }


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
    if names.shared is not None:
        gate, up = src.pop("mlp.shared_experts.linear_fc1.weight").chunk(2, dim=0)
        out[f"{prefix}{names.shared}{names.gate}.weight"], out[f"{prefix}{names.shared}{names.up}.weight"] = gate, up
        out.update({theirs: src.pop(ours) for ours, theirs in names.shared_names(prefix).items()})
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
    if names.shared is not None and key.startswith("decoder.layers.mlp.shared_experts."):
        if key.endswith("linear_fc1.weight"):
            shared = prefix + names.shared
            return torch.cat([hf.get(f"{shared}{names.gate}.weight"), hf.get(f"{shared}{names.up}.weight")])
        found = names.shared_names(prefix).get(key[len("decoder.layers.") :])
        return hf.get(found) if found else None
    if expert is None or ".mlp.experts." not in key:
        return None
    base = prefix + names.expert.format(e=expert)
    if key.endswith("linear_fc1.weight"):
        return torch.cat([hf.get(f"{base}{names.gate}.weight"), hf.get(f"{base}{names.up}.weight")])
    if key.endswith("linear_fc2.weight"):
        return hf.get(f"{base}{names.down}.weight")
    return None
