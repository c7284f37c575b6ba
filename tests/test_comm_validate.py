"""The validator's rules on the data-parallel traffic options (toolkit.plan.rules.comm, and the
comm_backend capability): each rejects a case naming the field and a fix and accepts its
neighbour; the warnings say when a setting costs and saves nothing. The base is the tiny model."""

import pytest

from toolkit.plan.validate import validate

FOUR = "cluster.gpus_per_node=4"
TWO_NODES = ["cluster.gpus_per_node=2", "cluster.nodes=2"]  # 4 ranks as 2 nodes of 2
DS3 = ["backend=deepspeed", "zero=3"]
GPU = ["cluster=h100_cluster", "model=llama3_8b", "precision=bf16", "train.global_batch=512"]

# rule, overrides it rejects, neighbouring overrides it accepts, a field the message must name
CASES = [
    (
        "comm_instances_zero",
        [FOUR, "comm.optimizer_instances=2", "zero=0"],
        [FOUR, "comm.optimizer_instances=2", "zero=1"],
        "comm.optimizer_instances",
    ),
    (
        "comm_instances_divide",
        [FOUR, "comm.optimizer_instances=3"],
        [FOUR, "comm.optimizer_instances=4"],
        "comm.optimizer_instances",
    ),
    # tp=2 leaves dp=2 of the 4 ranks: 4 instances do not divide them
    (
        "comm_instances_divide",
        [FOUR, "parallel.tp=2", "comm.optimizer_instances=4"],
        [FOUR, "parallel.tp=2", "comm.optimizer_instances=2"],
        "comm.optimizer_instances",
    ),
    # tiny_moe at ep=2 on 4 ranks: the experts' 2 data-parallel ranks take 2 instances, not 4
    (
        "comm_instances_experts",
        [FOUR, "model=tiny_moe", "parallel.ep=2", "comm.optimizer_instances=4"],
        [FOUR, "model=tiny_moe", "parallel.ep=2", "comm.optimizer_instances=2"],
        "comm.optimizer_instances",
    ),
    (
        "comm_zeropp_zero",
        [FOUR, "backend=deepspeed", "zero=2", "comm.hpz_partition_size=2"],
        [FOUR, *DS3, "comm.hpz_partition_size=2"],
        "comm.hpz_partition_size",
    ),
    (
        "comm_hpz_divide",
        [FOUR, *DS3, "comm.hpz_partition_size=3"],
        [FOUR, *DS3, "comm.hpz_partition_size=4"],
        "comm.hpz_partition_size",
    ),
    (
        "comm_quantized_device",
        [FOUR, *DS3, "comm.quantized_gradients=true"],
        [*GPU, *DS3, "comm.quantized_gradients=true"],
        "comm.quantized_gradients",
    ),
    (
        "comm_quantized_device",
        [FOUR, *DS3, "comm.quantized_weights=true"],
        [FOUR, *DS3],
        "comm.quantized_weights",
    ),
    (
        "comm_backend",
        [FOUR, "backend=deepspeed", "comm.optimizer_instances=2"],
        [FOUR, "comm.optimizer_instances=2"],
        "comm.optimizer_instances",
    ),
    (
        "comm_backend",
        [FOUR, "comm.hpz_partition_size=2"],
        [FOUR, *DS3, "comm.hpz_partition_size=2"],
        "comm.hpz_partition_size",
    ),
    (
        "comm_backend",
        [FOUR, "backend=deepspeed", "comm.bucket_size=1000"],
        [FOUR, "comm.bucket_size=1000"],
        "comm.bucket_size",
    ),
    ("range", [FOUR, "comm.optimizer_instances=0"], [FOUR, "comm.optimizer_instances=1"], "comm.optimizer_instances"),
]


@pytest.mark.parametrize("rule,bad,good,field", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_traffic_rule_rejects_with_its_field_and_fix_and_accepts_the_neighbour(compose, rule, bad, good, field):
    hits = [v for v in validate(compose(*bad)).errors if v.rule == rule]
    assert hits, validate(compose(*bad))
    assert field in str(hits[0]) and hits[0].fix
    assert not [v for v in validate(compose(*good)).errors if v.rule == rule], validate(compose(*good))


def test_the_fix_of_a_wrong_backend_names_the_one_that_has_the_option(compose):
    (hit,) = [v for v in validate(compose(FOUR, "backend=deepspeed", "comm.optimizer_instances=2")).errors]
    assert (
        hit.rule == "comm_backend"
        and hit.fix == "leave comm.optimizer_instances at its default, or use backend=megatron"
    )


def test_instances_that_span_nodes_are_warned_about(compose):
    """4 data-parallel ranks on 2 nodes of 2: 2 instances are a node each (quiet). 8 ranks on 4
    nodes of 2 in 2 instances: each instance's 4 ranks cross the network."""
    assert not validate(compose(*TWO_NODES, "comm.optimizer_instances=2")).warnings
    cfg = compose("cluster.gpus_per_node=2", "cluster.nodes=4", "comm.optimizer_instances=2")  # 8 ranks, 4 each
    (warning,) = [v for v in validate(cfg).warnings if v.rule == "comm_instances_span_nodes"]
    assert "spans 4 ranks, more than a node's 2" in warning.message and "{4, 8}" in warning.fix


def test_hpz_on_one_node_or_across_nodes_is_warned_about(compose):
    one_node = [v.rule for v in validate(compose(FOUR, *DS3, "comm.hpz_partition_size=2")).warnings]
    assert "comm_hpz_no_gain" in one_node
    across = validate(compose(*TWO_NODES, *DS3, "comm.hpz_partition_size=4")).warnings
    (warning,) = [v for v in across if v.rule == "comm_hpz_no_gain"]
    assert "spans nodes of 2" in warning.message and "comm.hpz_partition_size=2" in warning.fix
    assert not [
        v
        for v in validate(compose(*TWO_NODES, *DS3, "comm.hpz_partition_size=2")).warnings
        if v.rule == "comm_hpz_no_gain"
    ]


def test_quantized_collectives_where_traffic_is_small_are_warned_about(compose):
    """Llama 3 8B under ZeRO-3: on one node of 8 H100s the gradient traffic is about 1% of the step
    and qgZ would save under 1% while changing the numbers trained; so on 8 such nodes, whose NCCL
    rings cross over all 8 NICs of each; on 8 nodes with one NIC each it saves more."""
    zero3 = ["model=llama3_8b", "backend=deepspeed", "zero=3", "recompute=full", "train.global_batch=512"]
    qgz = "comm.quantized_gradients=true"

    def small(*overrides):
        return [v for v in validate(compose(*zero3, *overrides, qgz)).warnings if v.rule == "comm_compression_small"]

    (warning,) = small("cluster=8xh100")
    assert warning.fields == {"comm.quantized_gradients": True} and "would save 0." in warning.message
    assert small("cluster=h100_cluster")
    assert not small("cluster=h100_cluster", "cluster.nics_per_node=1")


def test_each_option_reaches_its_upstream_setting(compose):
    """What the options emit, read back by the upstream classes: megatron-core's
    DistributedDataParallelConfig and Megatron-LM's flags; DeepSpeed's ZeRO config."""
    from upstream import deepspeed_accepts, megatron_accepts

    from toolkit.emit.deepspeed import deepspeed_config
    from toolkit.emit.megatron import megatron_sections
    from toolkit.emit.megatron_args import megatron_args
    from toolkit.plan.layout import resolve

    cfg = compose(FOUR, "comm.optimizer_instances=2", "comm.bucket_size=1000000")
    layout = resolve(cfg)
    sections = megatron_sections(cfg, layout)
    _, _, ddp = megatron_accepts(sections)
    assert (ddp.num_distributed_optimizer_instances, ddp.bucket_size) == (2, 1_000_000)
    args = " ".join(megatron_args(cfg, layout, sections))
    assert "--num-distributed-optimizer-instances 2" in args and "--ddp-bucket-size 1000000" in args
    cfg = compose(
        *GPU, *DS3, "comm.hpz_partition_size=8", "comm.quantized_weights=true", "comm.quantized_gradients=true"
    )
    layout = resolve(cfg)
    zero = deepspeed_accepts(deepspeed_config(cfg, layout), dp=layout.dp).zero_config
    assert (zero.zero_hpz_partition_size, zero.zero_quantized_weights, zero.zero_quantized_gradients) == (8, True, True)
    plain = compose(FOUR, *DS3)
    zero = deepspeed_accepts(deepspeed_config(plain, resolve(plain)), dp=4).zero_config
    assert (zero.zero_hpz_partition_size, zero.zero_quantized_weights, zero.zero_quantized_gradients) == (
        1,
        False,
        False,
    )
