"""The parallel layout: the degrees against the world size, the model's dimensions they split,
and the pipeline's stages (megatron-core TransformerConfig.__post_init__ and Megatron-LM
arguments.py validate_args)."""

from __future__ import annotations

import math
from typing import Iterator

from toolkit.config.schema import Config
from toolkit.plan.backends import backend_of
from toolkit.plan.layout import padded_vocab_size, stage_layer_counts, world_size
from toolkit.plan.parallel_dims import DIMS, ParallelDims
from toolkit.plan.rules.base import Violation, divisors, err, listing, others


def world(cfg: Config) -> Iterator[Violation]:
    """dp times the ranks one model replica spans (the dimensions that split the model into more
    ranks: tp*pp*cp) is the cluster's device count."""
    p, c = cfg.parallel, cfg.cluster
    world = world_size(cfg)
    splits = [d.name for d in DIMS if d.multiplies_world and d.splits_model]
    product = "*".join(splits)
    model_parallel = ParallelDims.of(p, dp=1).model_parallel_size
    fields = {
        **{f"parallel.{name}": getattr(p, name) for name in splits},
        "cluster.nodes": c.nodes,
        "cluster.gpus_per_node": c.gpus_per_node,
    }
    if p.dp is not None and p.dp * model_parallel != world:
        fits = f"parallel.dp={world // model_parallel}" if world % model_parallel == 0 else "leave parallel.dp out"
        yield err(
            "world_size",
            {**fields, "parallel.dp": p.dp},
            f"dp*{product} = {p.dp * model_parallel} but the cluster has {world} devices",
            f"set {fits}, or size the cluster to {p.dp * model_parallel} devices",
        )
    elif world % model_parallel:
        yield err(
            "world_size",
            fields,
            f"{product} = {model_parallel} does not divide the {world} devices",
            f"use {product} in {{{listing(divisors(world))}}}, or a cluster of a multiple of {model_parallel} devices",
        )


def layout(cfg: Config) -> Iterator[Violation]:
    m, p, c = cfg.model, cfg.parallel, cfg.cluster
    kv = m.num_kv_heads or m.num_attention_heads
    # megatron-core TransformerConfig: heads % tp == 0, and KV heads either split evenly
    # (kv % tp == 0) or are replicated evenly (tp % kv == 0).
    if m.num_attention_heads % p.tp or (kv % p.tp and p.tp % kv):
        good = [d for d in divisors(m.num_attention_heads) if kv % d == 0 or d % kv == 0]
        yield err(
            "tp_heads",
            {"parallel.tp": p.tp, "model.num_attention_heads": m.num_attention_heads, "model.num_kv_heads": kv},
            "each tensor-parallel rank must hold whole attention heads, and KV heads must split or replicate evenly",
            f"use parallel.tp in {{{listing(good)}}}",
        )
    if m.ffn_hidden_size % p.tp:
        yield err(
            "tp_ffn",
            {"parallel.tp": p.tp, "model.ffn_hidden_size": m.ffn_hidden_size},
            "the MLP's columns do not split evenly across tensor-parallel ranks",
            f"use parallel.tp in {{{listing(divisors(m.ffn_hidden_size, 64))}}}",
        )
    padded = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    if backend_of(cfg).pads_vocab and padded % p.tp:
        multiple = math.lcm(m.make_vocab_size_divisible_by or 128, p.tp)
        yield err(
            "vocab_tp",
            {
                "model.vocab_size": m.vocab_size,
                "model.make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
                "parallel.tp": p.tp,
            },
            f"the embedding's {padded} rows (the vocabulary padded to a multiple of "
            "model.make_vocab_size_divisible_by, the same at every layout) do not split evenly across "
            "tensor-parallel ranks",
            f"use parallel.tp in {{{listing(divisors(padded, c.gpus_per_node))}}}, or set "
            f"model.make_vocab_size_divisible_by={multiple} (pads to {padded_vocab_size(m.vocab_size, multiple)} "
            "rows: another model, whose runs do not compare with this one's)",
        )
    if p.tp > c.gpus_per_node:
        yield err(
            "tp_in_node",
            {"parallel.tp": p.tp, "cluster.gpus_per_node": c.gpus_per_node},
            "tensor parallel communicates in every layer and must stay inside a node",
            f"use parallel.tp<={c.gpus_per_node} and add pipeline stages (parallel.pp) across nodes",
        )
    if p.sequence_parallel and p.tp == 1:
        yield err(
            "sp_needs_tp",
            {"parallel.sequence_parallel": True, "parallel.tp": 1},
            "sequence parallel splits the tensor-parallel region's activations and needs tp > 1",
            "set parallel.sequence_parallel=false, or parallel.tp>=2",
        )
    if p.tp_comm_overlap and not p.sequence_parallel:
        yield err(
            "tp_overlap_needs_sp",
            {"parallel.tp_comm_overlap": True, "parallel.sequence_parallel": False},
            "megatron-core overlaps the all-gathers and reduce-scatters of sequence parallel with the GEMMs; "
            "without it there is nothing to overlap (Megatron-LM asserts the same)",
            "set parallel.sequence_parallel=true (with parallel.tp>=2), or parallel.tp_comm_overlap=false",
        )
    if p.tp_comm_overlap and c.device != "cuda":
        yield err(
            "tp_overlap_device",
            {"parallel.tp_comm_overlap": True, "cluster.device": c.device},
            "the overlap runs in Transformer Engine's userbuffers, on CUDA devices only",
            "set parallel.tp_comm_overlap=false",
        )
    if p.sequence_parallel and m.seq_length % p.tp:
        yield err(
            "sp_seq",
            {"parallel.sequence_parallel": True, "model.seq_length": m.seq_length, "parallel.tp": p.tp},
            "sequence parallel needs the sequence length divisible by tp",
            f"use model.seq_length={m.seq_length - m.seq_length % p.tp or p.tp}",
        )
    if p.cp > 1 and m.seq_length % (2 * p.cp):
        yield err(
            "cp_seq",
            {"parallel.cp": p.cp, "model.seq_length": m.seq_length},
            "context parallel splits each sequence into 2*cp load-balanced chunks",
            f"use a model.seq_length divisible by {2 * p.cp}",
        )

    uneven = p.first_stage_layers is not None or p.last_stage_layers is not None
    if uneven and p.pp == 1:
        yield err(
            "pp_uneven",
            {
                "parallel.pp": 1,
                "parallel.first_stage_layers": p.first_stage_layers,
                "parallel.last_stage_layers": p.last_stage_layers,
            },
            "first/last stage layer counts need pipeline stages",
            "leave them out, or set parallel.pp>=2",
        )
    elif uneven and stage_layer_counts(m.num_layers, p.pp, p.vpp, p.first_stage_layers, p.last_stage_layers) is None:
        first, last = p.first_stage_layers or 0, p.last_stage_layers or 0
        middle = p.pp - (p.first_stage_layers is not None) - (p.last_stage_layers is not None)
        yield err(
            "pp_uneven",
            {
                "parallel.pp": p.pp,
                "parallel.vpp": p.vpp,
                "parallel.first_stage_layers": p.first_stage_layers,
                "parallel.last_stage_layers": p.last_stage_layers,
                "model.num_layers": m.num_layers,
            },
            f"the {m.num_layers - first - last} remaining layers must split evenly over {middle} middle stage(s), "
            "and every stage's layers must divide by vpp",
            uneven_fix(m.num_layers, p.pp, p.vpp),
        )
    elif not uneven and m.num_layers % (p.pp * p.vpp):
        stages = p.pp * p.vpp
        pps = [d for d in divisors(m.num_layers) if d * p.vpp <= m.num_layers and m.num_layers % (d * p.vpp) == 0]
        fix = f"use parallel.pp in {{{listing(pps)}}}" if pps else "use parallel.vpp=1"
        if p.vpp > 1 and m.num_layers % p.pp == 0:
            fix += f", or parallel.vpp in {{{listing(divisors(m.num_layers // p.pp))}}}"
        if p.pp > 2 and "parallel.first_stage_layers" in uneven_fix(m.num_layers, p.pp, p.vpp):
            fix += f", or an uneven split: {uneven_fix(m.num_layers, p.pp, p.vpp)}"
        yield err(
            "pp_layers",
            {"parallel.pp": p.pp, "parallel.vpp": p.vpp, "model.num_layers": m.num_layers},
            f"{m.num_layers} layers do not split into pp*vpp = {stages} equal model chunks",
            fix,
        )
    if p.vpp > 1 and p.pp == 1:
        yield err(
            "vpp_needs_pp",
            {"parallel.vpp": p.vpp, "parallel.pp": 1},
            "the interleaved schedule interleaves pipeline stages and needs pp > 1",
            "set parallel.vpp=1, or parallel.pp>=2",
        )


def uneven_fix(num_layers: int, pp: int, vpp: int) -> str:
    """An uneven split with fewer layers on the first and last stage, when one exists."""
    per_stage = -(-num_layers // pp)
    per_stage += (-per_stage) % vpp
    edge2 = num_layers - (pp - 2) * per_stage
    if pp > 2 and edge2 > 0 and edge2 % 2 == 0 and (edge2 // 2) % vpp == 0:
        return f"set parallel.first_stage_layers={edge2 // 2} parallel.last_stage_layers={edge2 // 2}"
    return "choose counts so that the middle stages get equal layers, each divisible by vpp"


def backend_dims(cfg: Config) -> Iterator[Violation]:
    """The model-parallel dimensions the layout uses that the backend does not train with."""
    p, be = cfg.parallel, backend_of(cfg)
    dims = ParallelDims.of(p, dp=1)
    # model-parallel dimension (or tensor parallel's options) -> (field, value), for those this
    # layout uses (etp left to follow tp is tp's)
    in_use = {
        d.name: (f"parallel.{d.name}", getattr(dims, d.name))
        for d in DIMS
        if d.splits_model and getattr(dims, d.name) > 1 and not dims.hidden(d)
    }
    for option, field in (("sp", "sequence_parallel"), ("tp_overlap", "tp_comm_overlap")):
        if getattr(p, field):
            in_use[option] = (f"parallel.{field}", True)
    unsupported = {field: value for dim, (field, value) in in_use.items() if dim not in be.parallel_dims}
    if unsupported:
        why = "".join(f" ({dim}: {reason})" for dim, reason in be.lacks if dim in in_use)
        yield err(
            f"{be.name}_layout",
            {**unsupported, "backend.name": be.name},
            f"the {be.name} backend trains with data parallel, ZeRO and "
            f"{', '.join(sorted(be.parallel_dims)) or 'no model'} parallelism only{why}",
            f"use {can} for {', '.join(unsupported)}"
            if (can := others(lambda o: set(in_use) <= o.parallel_dims))
            else f"set {' '.join(f'{field}=1' for field in unsupported)}: no backend trains with it",
        )
