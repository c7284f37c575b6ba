"""Mixture-of-experts layers and expert parallelism: what megatron-core's TransformerConfig
(__post_init__), its parallel_state (the expert mesh) and Megatron-LM's arguments.py
(validate_args) refuse, and the settings whose silent defaults surprise."""

from __future__ import annotations

from typing import Iterator

from toolkit.config.schema import Config, expert_ffn_size, is_moe, moe_layer_pattern
from toolkit.families import FAMILIES, family_of
from toolkit.plan.layout import resolve
from toolkit.plan.params import stage_moe_layers
from toolkit.plan.perf import estimate_step
from toolkit.plan.rules.base import Violation, configured_dims, divisors, err, listing, warn


def dense(cfg: Config) -> Iterator[Violation]:
    """Expert parallel on a model without experts (megatron-core: "num_moe_experts must be non None
    to use expert-parallel")."""
    p = cfg.parallel
    if not is_moe(cfg.model) and (p.ep > 1 or p.etp not in (None, p.tp)):
        yield err(
            "ep_dense",
            {"parallel.ep": p.ep, "parallel.etp": p.etp, "model.moe.num_experts": None},
            "expert parallel splits a mixture-of-experts model's experts, and this model has none",
            "set parallel.ep=1 and leave parallel.etp unset, or give the model experts (model.moe.num_experts)",
        )


def family(cfg: Config) -> Iterator[Violation]:
    """A Hugging Face family is either a mixture of experts (Mixtral, Qwen3-MoE) or dense, with or
    without QK layernorm (Qwen3): its config and weights express only that."""
    m = cfg.model
    fam = family_of(m.family)
    if fam.moe != is_moe(m):
        kinds = [name for name, f in FAMILIES.items() if f.moe == is_moe(m)]
        yield err(
            "moe_family",
            {"model.family": m.family, "model.moe.num_experts": m.moe.num_experts},
            f"family {m.family} is a {'mixture-of-experts' if fam.moe else 'dense'} architecture and this model "
            f"{'has no experts' if fam.moe else 'has experts'}",
            f"use model.family in {{{listing(kinds)}}}" + ("" if is_moe(m) else ", or set model.moe.num_experts"),
        )

    if fam.qk_layernorm != m.qk_layernorm:
        yield err(
            "family_qk_layernorm",
            {"model.family": m.family, "model.qk_layernorm": m.qk_layernorm},
            f"family {m.family} {'normalises' if fam.qk_layernorm else 'does not normalise'} "
            "each head's queries and keys",
            f"set model.qk_layernorm={str(fam.qk_layernorm).lower()}",
        )


def experts(cfg: Config) -> Iterator[Violation]:
    m, p = cfg.model, cfg.parallel
    if not is_moe(m):
        return
    moe, dims = m.moe, configured_dims(cfg)
    attention_ranks = dims.tp * dims.cp * dims.dp  # the ranks of one pipeline stage
    if moe.router_topk > moe.num_experts:
        yield err(
            "moe_topk",
            {"model.moe.router_topk": moe.router_topk, "model.moe.num_experts": moe.num_experts},
            "each token is routed to more experts than the layer has",
            f"set model.moe.router_topk<={moe.num_experts}",
        )
    if moe.num_experts % dims.ep:
        good = [e for e in divisors(moe.num_experts) if attention_ranks % (e * dims.etp) == 0]
        yield err(
            "moe_ep",
            {"parallel.ep": dims.ep, "model.moe.num_experts": moe.num_experts},
            "each expert-parallel rank must hold the same number of whole experts",
            f"use parallel.ep in {{{listing(good)}}}",
        )
    # parallel_state.initialize_model_parallel: the expert mesh etp x ep x expert-dp folds into the
    # tp x cp x dp ranks of each pipeline stage
    if attention_ranks % (dims.ep * dims.etp):
        good = [e for e in divisors(moe.num_experts) if attention_ranks % (e * dims.etp) == 0]
        yield err(
            "expert_mesh",
            {"parallel.ep": dims.ep, "parallel.etp": dims.etp, "tp*cp*dp": attention_ranks},
            f"the experts fold into each pipeline stage's {attention_ranks} ranks (tp*cp*dp), and "
            f"ep*etp = {dims.ep * dims.etp} does not divide them",
            f"use parallel.ep in {{{listing(good)}}}"
            + (f" (etp={dims.etp}), or parallel.etp=1" if dims.etp > 1 else ""),
        )
    if expert_ffn_size(m) % dims.etp:
        yield err(
            "moe_ffn_etp",
            {"parallel.etp": dims.etp, "model.moe.ffn_hidden_size": expert_ffn_size(m)},
            "each expert's FFN columns do not split evenly across the expert-tensor-parallel ranks",
            f"use parallel.etp in {{{listing(divisors(expert_ffn_size(m), 64))}}}",
        )
    if moe.shared_expert_size and moe.shared_expert_size % dims.tp:
        yield err(
            "moe_shared_tp",
            {"parallel.tp": dims.tp, "model.moe.shared_expert_size": moe.shared_expert_size},
            "the shared experts are split like the dense MLP, over the tensor-parallel ranks",
            f"use parallel.tp in {{{listing(divisors(moe.shared_expert_size, 64))}}}",
        )
    # megatron-core's MoELayer.forward refuses to train with tensor parallel but no sequence
    # parallel (moe_layer.py; Megatron-LM's validate_args too): each tp rank would route the same
    # tokens again
    if dims.tp > 1 and not p.sequence_parallel:
        yield err(
            "moe_tp_sp",
            {"parallel.tp": dims.tp, "parallel.sequence_parallel": False},
            "mixture-of-experts layers with tensor parallel need sequence parallel (megatron-core refuses "
            "to train without it)",
            "set parallel.sequence_parallel=true",
        )
    yield from _router(cfg)
    yield from _layers(cfg)


def _router(cfg: Config) -> Iterator[Violation]:
    """The router and capacity settings TransformerConfig.__post_init__ refuses."""
    moe = cfg.model.moe
    if moe.router_topk == 1 and moe.norm_topk_prob and moe.score_function == "softmax":
        yield err(
            "moe_top1_softmax",
            {"model.moe.router_topk": 1, "model.moe.norm_topk_prob": True},
            "renormalising a single expert's softmax weight gives 1 and no gradient to the router "
            "(megatron-core asks for the softmax before the top-k)",
            "set model.moe.norm_topk_prob=false (Switch Transformer's top-1 routing), or model.moe.router_topk>=2",
        )
    if moe.load_balancing == "expert_bias" and moe.score_function != "sigmoid":
        yield err(
            "moe_expert_bias_score",
            {"model.moe.load_balancing": "expert_bias", "model.moe.score_function": moe.score_function},
            "megatron-core's aux-loss-free expert bias ranks sigmoid scores only (as DeepSeek-V3)",
            "set model.moe.score_function=sigmoid, or another model.moe.load_balancing",
        )
    if moe.capacity_factor is not None and moe.load_balancing == "expert_bias":
        yield err(
            "moe_capacity_balancing",
            {"model.moe.capacity_factor": moe.capacity_factor, "model.moe.load_balancing": "expert_bias"},
            "megatron-core drops tokens over capacity only with aux_loss, seq_aux_loss or no load balancing",
            "leave model.moe.capacity_factor unset (dropless), or set model.moe.load_balancing=aux_loss",
        )
    if moe.pad_to_capacity and moe.capacity_factor is None:
        yield err(
            "moe_pad_capacity",
            {"model.moe.pad_to_capacity": True, "model.moe.capacity_factor": None},
            "padding each expert's input to its capacity needs a capacity (dropless routing has none)",
            "set model.moe.capacity_factor (e.g. 1.0), or model.moe.pad_to_capacity=false",
        )
    if moe.token_dispatcher == "flex" and cfg.parallel.tp * cfg.parallel.ep == 1:
        yield err(
            "moe_flex_ranks",
            {"model.moe.token_dispatcher": "flex", "parallel.tp": cfg.parallel.tp, "parallel.ep": cfg.parallel.ep},
            "the flex dispatcher's kernels exchange tokens between expert ranks, and there is one",
            "set model.moe.token_dispatcher=alltoall, or parallel.ep>=2",
        )


def _layers(cfg: Config) -> Iterator[Violation]:
    m = cfg.model
    outside = [i for i in m.moe.dense_layers if not 0 <= i < m.num_layers]
    if outside:
        yield err(
            "moe_dense_layers",
            {"model.moe.dense_layers": list(m.moe.dense_layers), "model.num_layers": m.num_layers},
            f"layers {listing(outside)} do not exist (layers are numbered 0..{m.num_layers - 1})",
            f"list layers in 0..{m.num_layers - 1}",
        )
    elif not any(moe_layer_pattern(m)):
        yield err(
            "moe_no_layers",
            {"model.moe.layer_freq": m.moe.layer_freq, "model.moe.dense_layers": list(m.moe.dense_layers)},
            "no layer is left a mixture-of-experts layer",
            "set model.moe.layer_freq=1 and model.moe.dense_layers=[], or model.moe.num_experts=null for a dense model",
        )


def etp_default(cfg: Config) -> Iterator[Violation]:
    """A warning: etp left unset follows tp, so tp2 ep4 spreads each MoE layer over 8 ranks."""
    p = cfg.parallel
    if is_moe(cfg.model) and p.etp is None and p.tp > 1 and p.ep > 1:
        yield warn(
            "etp_follows_tp",
            {"parallel.tp": p.tp, "parallel.ep": p.ep, "parallel.etp": None},
            f"parallel.etp is unset and follows tp, as megatron-core's: each expert is split over {p.tp} ranks "
            f"and each MoE layer spans etp*ep = {p.tp * p.ep} ranks",
            f"set parallel.etp={p.tp} to keep it, or parallel.etp=1 to keep each expert whole "
            f"(an expert group of {p.ep} ranks)",
        )


# A pipeline whose stages idle this share of the slowest stage's time, because they hold fewer MoE
# layers, is worth rebalancing.
STAGE_IDLE_WORTH = 0.05


def stage_balance(cfg: Config) -> Iterator[Violation]:
    """A warning: pipeline stages that hold different numbers of MoE layers (an uneven split, or
    layer_freq and dense_layers that fall unevenly) run at different speeds, and the slowest stage
    sets the pipeline's pace (the planner's stage times)."""
    m, p = cfg.model, cfg.parallel
    if not is_moe(m) or p.pp == 1:
        return
    layout = resolve(cfg)
    counts = [stage_moe_layers(m, p.pp, p.vpp, layout.stage_layers, s) for s in range(p.pp)]
    if len(set(counts)) == 1:
        return
    times = estimate_step(cfg, layout).stage_times
    idle = 1 - sum(times) / len(times) / max(times)
    if idle >= STAGE_IDLE_WORTH:
        yield warn(
            "moe_stage_imbalance",
            {
                "parallel.pp": p.pp,
                "model.moe.layer_freq": m.moe.layer_freq,
                "model.moe.dense_layers": list(m.moe.dense_layers),
            },
            f"the pipeline stages hold {listing(counts)} MoE layers: the slowest stage sets the pace, and the stages "
            f"idle {idle:.0%} of its time on average (the planner's stage times)",
            "move layers between stages (parallel.first_stage_layers, parallel.last_stage_layers), or choose "
            "model.moe.dense_layers so that every stage holds as many MoE layers",
        )
