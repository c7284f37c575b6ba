"""The data-parallel traffic options (comm.*) against what they need: megatron-core's optimizer
instances the distributed optimizer and a divisor of the dp x cp ranks (parallel_state.
initialize_model_parallel), ZeRO++ ZeRO-3 and a divisor of the world (DeepSpeed's
groups._create_zero_param_parallel_group) and, for its quantized collectives, CUDA kernels; and the
settings that cost more than they save (warnings)."""

from __future__ import annotations

import dataclasses
from typing import Iterator

from toolkit.config.schema import Config, is_moe
from toolkit.plan.layout import resolve, world_size
from toolkit.plan.perf import estimate_step
from toolkit.plan.rules.base import Violation, configured_dims, divisors, err, listing, warn


def _dp_ranks(cfg: Config) -> tuple[int, int]:
    """(the dp x cp ranks of one model replica's shard group, the stride between them)."""
    dims = configured_dims(cfg)
    return dims.dp * dims.cp, dims.stride("cp")


def instances(cfg: Config) -> Iterator[Violation]:
    n = cfg.comm.optimizer_instances
    if n == 1:
        return
    if cfg.zero.stage != 1:
        yield err(
            "comm_instances_zero",
            {"comm.optimizer_instances": n, "zero.stage": cfg.zero.stage},
            "optimizer instances shard the distributed optimizer's state, which ZeRO-1 turns on",
            "set zero=1, or comm.optimizer_instances=1",
        )
    ranks, stride = _dp_ranks(cfg)
    if ranks % n:
        yield err(
            "comm_instances_divide",
            {"comm.optimizer_instances": n, "dp*cp": ranks},
            f"the {ranks} data-parallel ranks do not split into {n} equal optimizer instances",
            f"use comm.optimizer_instances in {{{listing(divisors(ranks))}}}",
        )
    # the experts' optimizer splits into instances over their expert-data-parallel ranks too
    # (parallel_state.initialize_model_parallel asserts it)
    edp = configured_dims(cfg).edp
    if is_moe(cfg.model) and edp % n:
        fits = [d for d in divisors(ranks) if edp % d == 0]
        yield err(
            "comm_instances_experts",
            {"comm.optimizer_instances": n, "expert-dp": edp},
            f"the experts' {edp} data-parallel ranks do not split into {n} equal optimizer instances",
            f"use comm.optimizer_instances in {{{listing(fits)}}}, or a smaller parallel.ep",
        )


def _zeropp(cfg: Config) -> dict:
    c = cfg.comm
    return {
        "comm.hpz_partition_size": c.hpz_partition_size,
        "comm.quantized_weights": c.quantized_weights,
        "comm.quantized_gradients": c.quantized_gradients,
    }


def zeropp(cfg: Config) -> Iterator[Violation]:
    c = cfg.comm
    asked = {k: v for k, v in _zeropp(cfg).items() if v is True or (not isinstance(v, bool) and v > 1)}
    if not asked:
        return
    if cfg.zero.stage != 3:
        yield err(
            "comm_zeropp_zero",
            {**asked, "zero.stage": cfg.zero.stage},
            "ZeRO++ (hierarchical and quantized partitions) changes how ZeRO-3 gathers parameters and reduces "
            "gradients",
            "set zero=3, or " + " and ".join(f"{k}={'1' if k.endswith('size') else 'false'}" for k in asked),
        )
    world = world_size(cfg)
    if world % c.hpz_partition_size:
        yield err(
            "comm_hpz_divide",
            {"comm.hpz_partition_size": c.hpz_partition_size, "world_size": world},
            f"the {world} ranks do not split into secondary partitions of {c.hpz_partition_size}",
            f"use comm.hpz_partition_size in {{{listing(divisors(world))}}}",
        )
    quantized = {k: v for k, v in asked.items() if k.startswith("comm.quantized")}
    if quantized and cfg.cluster.device != "cuda":
        yield err(
            "comm_quantized_device",
            {**quantized, "cluster.device": cfg.cluster.device},
            "ZeRO++'s quantized collectives run DeepSpeed's CUDA quantization kernels (ops/quantizer)",
            " and ".join(f"set {k}=false" for k in quantized) + " on this cluster",
        )


def costly(cfg: Config) -> Iterator[Violation]:
    """Warnings: settings that cost memory or traffic and save none on this cluster."""
    c, per_node = cfg.comm, cfg.cluster.gpus_per_node
    if c.optimizer_instances > 1:
        ranks, stride = _dp_ranks(cfg)
        n = c.optimizer_instances
        if ranks // n * stride > per_node:
            fits = [d for d in divisors(ranks) if ranks // d * stride <= per_node]
            yield warn(
                "comm_instances_span_nodes",
                {"comm.optimizer_instances": n, "cluster.gpus_per_node": per_node},
                f"each optimizer instance spans {ranks // n * stride} ranks, more than a node's {per_node}: its "
                "reduce-scatter crosses the network as the flat one does, and the all-reduce across instances adds "
                "to it",
                f"use comm.optimizer_instances in {{{listing(fits)}}} (one node's ranks per instance or fewer)",
            )
    world = world_size(cfg)
    if c.hpz_partition_size > 1 and (world <= per_node or c.hpz_partition_size > per_node):
        why = (
            "every rank is on one node: the primary partition's all-gather is already inside it"
            if world <= per_node
            else f"a secondary partition of {c.hpz_partition_size} ranks spans nodes of {per_node}"
        )
        yield warn(
            "comm_hpz_no_gain",
            {"comm.hpz_partition_size": c.hpz_partition_size, "cluster.gpus_per_node": per_node},
            f"hpZ keeps a second copy of the parameters to gather them inside a node, and {why}: it costs memory "
            "and saves no network traffic",
            f"use comm.hpz_partition_size={min(per_node, world)} on several nodes, or 1",
        )
    yield from _compression(cfg)


# Below this share of the step a compressed collective saves too little to be worth changing the
# numbers the training computes (int8 weights, int4 gradients) for.
COMPRESSION_WORTH = 0.03


def _compression(cfg: Config) -> Iterator[Violation]:
    """A warning: quantized collectives where the data-parallel traffic is a small share of the step."""
    c = cfg.comm
    asked = {f"comm.{k}": True for k in ("quantized_weights", "quantized_gradients") if getattr(c, k)}
    if not asked:
        return
    plain = dataclasses.replace(cfg, comm=dataclasses.replace(c, quantized_weights=False, quantized_gradients=False))
    layout = resolve(cfg)
    without, with_ = estimate_step(plain, layout), estimate_step(cfg, layout)
    saving = 1 - with_.step_time / without.step_time
    if saving < COMPRESSION_WORTH:
        yield warn(
            "comm_compression_small",
            asked,
            f"the data-parallel traffic is {without.dp_comm / without.step_time:.0%} of the step here: the quantized "
            f"collectives would save {saving:.1%} of it (the planner's figure) while changing the numbers trained "
            "(int8 weights, int4 gradients)",
            " and ".join(f"set {k}=false" for k in asked),
        )
