"""The planner's data-parallel traffic (toolkit.plan.perf.data_parallel_comm, toolkit.plan.traffic):
each arrangement priced against the alpha-beta times of its collectives computed here from the
cluster's links (Thakur et al. 2005: factor (g-1)/g of the bytes per GPU, factor (g-1) latencies; across
nodes NCCL's rings cross over the NICs of the group's GPUs on each node, tests/test_collectives_nccl.py),
the memory each costs, and `parakit plan` naming the traffic's share and each remedy's saving.

The case is the guide's: Llama 3 8B on 64 H100s (8 nodes) in pure data parallel, gradients
reduced once after the backward (zero.overlap_comm=false), so that the traffic is all exposed."""

import json

import pytest

from toolkit.plan.collectives import COLLECTIVE_EFFICIENCY, NETWORK_EFFICIENCY
from toolkit.plan.layout import resolve
from toolkit.plan.memory import peak_memory
from toolkit.plan.perf import QUANTIZED_GRAD_BYTES, QUANTIZED_WEIGHT_BYTES, estimate_step
from toolkit.plan.search import search
from toolkit.plan.traffic import remedies

DP64 = [
    "model=llama3_8b",
    "cluster=h100_cluster",
    "precision=bf16",
    "train.global_batch=512",
    "parallel.tp=1",
    "train.micro_batch=1",
    "zero.overlap_comm=false",
]


def ring(cfg, nbytes: float, group: int, per_node: int, factor: float) -> float:
    """One ring collective over `group` GPUs, `per_node` of them on each node (all: the node's links),
    independently of the planner's code: the alpha-beta model written out. Across nodes the ring
    crosses over the per_node GPUs' NICs (one each on these H100 nodes), bounded by NVLink."""
    c = cfg.cluster
    nvlink = c.intra_node_bandwidth_gbs * COLLECTIVE_EFFICIENCY
    network = per_node * c.inter_node_bandwidth_gbs * NETWORK_EFFICIENCY
    bandwidth = (nvlink if per_node >= group else min(nvlink, network)) * 1e9
    return factor * (group - 1) * c.collective_latency_s + factor * (group - 1) / group * nbytes / bandwidth


def dp_comm(cfg) -> float:
    return estimate_step(cfg, resolve(cfg)).dp_comm


def params(cfg) -> int:
    from toolkit.plan.params import all_stage_params

    layout = resolve(cfg)
    (stage,) = all_stage_params(cfg.model, layout.padded_vocab_size, 1, 1, layout.stage_layers, 1, 1, 1)
    return stage.total


def test_optimizer_instances_reduce_in_the_node_then_across_instances(compose):
    """Flat: reduce-scatter of the fp32 gradients and all-gather of the bf16 parameters over 64 GPUs
    on the network. 8 instances (a node each): reduce-scatter over the node's 8, all-reduce of
    the 1/8 shard across the 8 instances, all-gather over the node's 8."""
    flat_cfg = compose(*DP64)
    p = params(flat_cfg)
    flat = ring(flat_cfg, 4 * p, 64, 8, 1) + ring(flat_cfg, 2 * p, 64, 8, 1)
    assert dp_comm(flat_cfg) == pytest.approx(flat, rel=1e-9)
    cfg = compose(*DP64, "comm.optimizer_instances=8")
    two_level = ring(cfg, 4 * p, 8, 8, 1) + ring(cfg, 4 * p / 8, 8, 1, 2) + ring(cfg, 2 * p, 8, 8, 1)
    assert dp_comm(cfg) == pytest.approx(two_level, rel=1e-9)
    # NCCL's flat ring already crosses over all 8 NICs of each node; the instances' all-reduce sends the
    # fp32 shard twice (7/8 x 4p per node, against the flat ring's 4p + 2p), after the node's own
    # phases: on these nodes the arrangement saves no time (Megatron's instances serve scale, not bandwidth)
    assert dp_comm(cfg) > dp_comm(flat_cfg)
    # the optimizer state is sharded over 8 ranks instead of 64: replicated 8 times
    grow = peak_memory(cfg, resolve(cfg)).optimizer / peak_memory(flat_cfg, resolve(flat_cfg)).optimizer
    assert grow == pytest.approx(8, rel=1e-9)


def test_zeropp_gathers_in_the_node_and_sends_fewer_bytes(compose):
    """ZeRO-3 per micro-batch: a forward and a backward all-gather of the bf16 parameters and a
    reduce-scatter of the fp32 gradients over the 64 GPUs. hpZ moves the backward gather into the
    node (and keeps a second copy of the parameters over 8 ranks), qwZ gathers int8, qgZ reduces
    int4 inside the node and 1/8 of it across nodes."""
    zero3 = [*DP64, "backend=deepspeed", "zero=3", "recompute=full"]
    base = compose(*zero3)
    p, mb = params(base), resolve(base).num_microbatches
    gather, reduce = ring(base, 2 * p, 64, 8, 1), ring(base, 4 * p, 64, 8, 1)
    assert dp_comm(base) == pytest.approx(mb * (reduce + 2 * gather), rel=1e-9)
    hpz = compose(*zero3, "comm.hpz_partition_size=8")
    assert dp_comm(hpz) == pytest.approx(mb * (reduce + gather + ring(hpz, 2 * p, 8, 8, 1)), rel=1e-9)
    extra = peak_memory(hpz, resolve(hpz)).weights - peak_memory(base, resolve(base)).weights
    assert extra == pytest.approx(2 * p / 8, rel=1e-9)
    assert QUANTIZED_WEIGHT_BYTES == 1.0 and QUANTIZED_GRAD_BYTES == 0.5  # int8 and int4 on the wire
    # qwZ and qgZ need CUDA kernels, which this planning needs not: the cluster is H100s
    zeropp = compose(
        *zero3, "comm.hpz_partition_size=8", "comm.quantized_weights=true", "comm.quantized_gradients=true"
    )
    qgz = ring(zeropp, 0.5 * p, 8, 8, 1) + ring(zeropp, 0.5 * p / 8, 8, 1, 1)
    qwz = ring(zeropp, 1.0 * p, 64, 8, 1) + ring(zeropp, 1.0 * p, 8, 8, 1)
    assert dp_comm(zeropp) == pytest.approx(mb * (qgz + qwz), rel=1e-9)


def test_remedies_are_priced_validated_and_ordered(compose):
    """For the flat megatron layout: the 16-bit reduction and the overlap are offered (each shortening
    the step it predicts); 8 optimizer instances are not (they save no time: the test above), nor is
    ZeRO++ (megatron has none)."""
    cfg = compose(*DP64)
    layout = resolve(cfg)
    step = estimate_step(cfg, layout).step_time
    found = remedies(cfg, layout)
    offered = [" ".join(r.overrides) for r in found]
    assert set(offered) == {"precision.grad_reduce_in_fp32=false", "zero.overlap_comm=true"}
    assert [r.step_time for r in found] == sorted(r.step_time for r in found) and all(r.step_time < step for r in found)
    for r in found:
        assert r.step_time == pytest.approx(estimate_step(r.cfg, resolve(r.cfg)).step_time, rel=1e-12)
    # ZeRO-3 on DeepSpeed: hpZ, qwZ, qgZ and all three
    zero3 = compose(*DP64, "backend=deepspeed", "zero=3", "recompute=full")
    offered = {" ".join(r.overrides) for r in remedies(zero3, resolve(zero3))}
    assert {"comm.hpz_partition_size=8", "comm.quantized_weights=true", "comm.quantized_gradients=true"} <= offered


def test_the_search_tries_the_settings_that_change_no_number(compose):
    """DeepSpeed on nodes with 2 NICs for their 8 GPUs: hpZ's in-node gather beats the ring across
    nodes, and the search ranks each ZeRO-3 layout with it above the same layout without it (not the
    quantized reductions, which change the numbers trained)."""
    cfg = compose(*DP64[:3], "train.global_batch=512", "train=pretrain", "backend=deepspeed", "cluster.nics_per_node=2")
    result = search(cfg)
    with_comm = [c for c in result.ranked if c.traffic_settings()]
    assert with_comm and all(s.startswith("comm.hpz_partition_size=") for c in with_comm for s in c.traffic_settings())
    for c in with_comm:
        plain = next(
            p
            for p in result.ranked
            if not p.traffic_settings() and p.overrides() == c.overrides()[: -len(c.traffic_settings())]
        )
        assert c.step.step_time < plain.step.step_time
        assert result.ranked.index(c) < result.ranked.index(plain)


def test_plan_names_the_traffic_share_and_each_remedy(capsys):
    from toolkit import cli

    assert cli.main(["plan", *DP64, "--top", "1"]) == 0
    out = capsys.readouterr().out
    share = next(line for line in out.splitlines() if "data-parallel traffic" in line)
    assert "s exposed" in share and "% of the" in share
    assert "precision.grad_reduce_in_fp32=false: step -" in out and "GiB per GPU" in out
    assert cli.main(["plan", *DP64, "--top", "1", "--json"]) == 0
    traffic = json.loads(capsys.readouterr().out)["configured"]["traffic"]
    assert 0 < traffic["share"] < 1 and {tuple(r["overrides"]) for r in traffic["remedies"]} >= {
        ("precision.grad_reduce_in_fp32=false",)
    }


def test_optimizer_instances_replicate_the_experts_state_too(compose):
    """Mixtral 8x7B on 64 H100s at pp4 ep8: dp 16, the experts' dp 2. Two optimizer instances
    halve both shard groups, so the whole optimizer state doubles (the experts' as well)."""
    moe = ["model=mixtral_8x7b", "cluster=h100_cluster", "train.global_batch=256", "parallel.pp=4", "parallel.ep=8"]
    flat, two = compose(*moe), compose(*moe, "comm.optimizer_instances=2")
    ratio = peak_memory(two, resolve(two)).optimizer / peak_memory(flat, resolve(flat)).optimizer
    assert ratio == pytest.approx(2, rel=1e-9)
