"""The planner's data-parallel traffic (toolkit.plan.perf.data_parallel_comm, toolkit.plan.traffic):
each arrangement priced against the alpha-beta times of its collectives computed here from the
cluster's links (Thakur et al. 2005: factor (g-1)/g of the bytes per GPU, factor (g-1) latencies),
the memory each costs, and `parakit plan` naming the traffic's share and each remedy's saving.

The case is the guide's: Llama 3 8B on 64 H100s (8 nodes) in pure data parallel, gradients
reduced once after the backward (zero.overlap_comm=false), so that the traffic is all exposed."""

import json

import pytest

from toolkit.plan.collectives import COLLECTIVE_EFFICIENCY
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


def ring(cfg, nbytes: float, group: int, intra: bool, factor: float) -> float:
    """One ring collective over `group` GPUs on the node's links or the network (independently of
    the planner's code: the alpha-beta model written out)."""
    c = cfg.cluster
    bandwidth = (c.intra_node_bandwidth_gbs if intra else c.inter_node_bandwidth_gbs) * 1e9 * COLLECTIVE_EFFICIENCY
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
    flat = ring(flat_cfg, 4 * p, 64, False, 1) + ring(flat_cfg, 2 * p, 64, False, 1)
    assert dp_comm(flat_cfg) == pytest.approx(flat, rel=1e-9)
    cfg = compose(*DP64, "comm.optimizer_instances=8")
    two_level = ring(cfg, 4 * p, 8, True, 1) + ring(cfg, 4 * p / 8, 8, False, 2) + ring(cfg, 2 * p, 8, True, 1)
    assert dp_comm(cfg) == pytest.approx(two_level, rel=1e-9)
    assert dp_comm(cfg) < 0.3 * dp_comm(flat_cfg)  # the network carries an eighth of the gradients, twice
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
    gather, reduce = ring(base, 2 * p, 64, False, 1), ring(base, 4 * p, 64, False, 1)
    assert dp_comm(base) == pytest.approx(mb * (reduce + 2 * gather), rel=1e-9)
    hpz = compose(*zero3, "comm.hpz_partition_size=8")
    assert dp_comm(hpz) == pytest.approx(mb * (reduce + gather + ring(hpz, 2 * p, 8, True, 1)), rel=1e-9)
    extra = peak_memory(hpz, resolve(hpz)).weights - peak_memory(base, resolve(base)).weights
    assert extra == pytest.approx(2 * p / 8, rel=1e-9)
    assert QUANTIZED_WEIGHT_BYTES == 1.0 and QUANTIZED_GRAD_BYTES == 0.5  # int8 and int4 on the wire
    # qwZ and qgZ need CUDA kernels, which this planning needs not: the cluster is H100s
    zeropp = compose(
        *zero3, "comm.hpz_partition_size=8", "comm.quantized_weights=true", "comm.quantized_gradients=true"
    )
    qgz = ring(zeropp, 0.5 * p, 8, True, 1) + ring(zeropp, 0.5 * p / 8, 8, False, 1)
    qwz = ring(zeropp, 1.0 * p, 64, False, 1) + ring(zeropp, 1.0 * p, 8, True, 1)
    assert dp_comm(zeropp) == pytest.approx(mb * (qgz + qwz), rel=1e-9)


def test_remedies_are_priced_validated_and_ordered(compose):
    """For the flat megatron layout: 8 optimizer instances, the 16-bit reduction and the overlap
    are offered (each shortening the step it predicts); ZeRO++ is not (megatron has none)."""
    cfg = compose(*DP64)
    layout = resolve(cfg)
    step = estimate_step(cfg, layout).step_time
    found = remedies(cfg, layout)
    offered = [" ".join(r.overrides) for r in found]
    assert set(offered) == {
        "comm.optimizer_instances=8",
        "precision.grad_reduce_in_fp32=false",
        "zero.overlap_comm=true",
    }
    assert [r.step_time for r in found] == sorted(r.step_time for r in found) and all(r.step_time < step for r in found)
    for r in found:
        assert r.step_time == pytest.approx(estimate_step(r.cfg, resolve(r.cfg)).step_time, rel=1e-12)
    instances = next(r for r in found if r.overrides == ("comm.optimizer_instances=8",))
    assert instances.memory_delta > 0  # the optimizer state replicated 8 times
    # ZeRO-3 on DeepSpeed: hpZ, qwZ, qgZ and all three
    zero3 = compose(*DP64, "backend=deepspeed", "zero=3", "recompute=full")
    offered = {" ".join(r.overrides) for r in remedies(zero3, resolve(zero3))}
    assert {"comm.hpz_partition_size=8", "comm.quantized_weights=true", "comm.quantized_gradients=true"} <= offered


def test_the_search_tries_the_settings_that_change_no_number(compose):
    cfg = compose(*DP64[:3], "train.global_batch=512", "train=pretrain")
    result = search(cfg)
    with_comm = [c for c in result.ranked if c.traffic_settings()]
    assert with_comm and all(s.startswith("comm.optimizer_instances=") for c in with_comm for s in c.traffic_settings())
    top = result.ranked[0]
    assert top.traffic_settings() and "comm.optimizer_instances=" in " ".join(top.overrides())
    plain = next(c for c in result.ranked if c.layout.dims == top.layout.dims and not c.traffic_settings())
    assert top.step.step_time < plain.step.step_time


def test_plan_names_the_traffic_share_and_each_remedy(capsys):
    from toolkit import cli

    assert cli.main(["plan", *DP64, "--top", "1"]) == 0
    out = capsys.readouterr().out
    share = next(line for line in out.splitlines() if "data-parallel traffic" in line)
    assert "s exposed" in share and "% of the" in share
    assert "comm.optimizer_instances=8: step -" in out and "GiB per GPU" in out
    assert cli.main(["plan", *DP64, "--top", "1", "--json"]) == 0
    traffic = json.loads(capsys.readouterr().out)["configured"]["traffic"]
    assert 0 < traffic["share"] < 1 and {tuple(r["overrides"]) for r in traffic["remedies"]} >= {
        ("comm.optimizer_instances=8",)
    }


def test_optimizer_instances_replicate_the_experts_state_too(compose):
    """Mixtral 8x7B on 64 H100s at pp4 ep8: dp 16, the experts' dp 2. Two optimizer instances
    halve both shard groups, so the whole optimizer state doubles (the experts' as well)."""
    moe = ["model=mixtral_8x7b", "cluster=h100_cluster", "train.global_batch=256", "parallel.pp=4", "parallel.ep=8"]
    flat, two = compose(*moe), compose(*moe, "comm.optimizer_instances=2")
    ratio = peak_memory(two, resolve(two)).optimizer / peak_memory(flat, resolve(flat)).optimizer
    assert ratio == pytest.approx(2, rel=1e-9)
