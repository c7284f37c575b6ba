"""The planner's collectives against published nccl-tests figures (tests/data/nccl_tests_published.yaml):
toolkit.plan.collectives.bus_gbs, the bus bandwidth of a large all-reduce over a group, as NCCL runs
it across nodes (a ring channel per NIC, the tree on two nodes, NVLink SHARP where declared).

TOLERANCE is 20%: the same hardware spreads that much between published runs (8 H100s per node with
8x 400 Gb/s NICs: 320 GB/s on one RoCE cluster at 4 nodes, ~380 in NVIDIA's GTC 2024 figures), and the
model predicts what the hardware can do, not how a given fabric or NCCL version is tuned."""

from pathlib import Path

import pytest
import yaml

from toolkit.plan.collectives import COLLECTIVE_EFFICIENCY, NETWORK_EFFICIENCY, bus_gbs, link_gbs

POINTS = yaml.safe_load((Path(__file__).parent / "data" / "nccl_tests_published.yaml").read_text())["points"]
TOLERANCE = 0.20


@pytest.mark.parametrize("point", POINTS, ids=[p["id"] for p in POINTS])
def test_all_reduce_bus_bandwidth_matches_published_nccl_tests(compose, point):
    cfg = compose(*point["cluster"])
    assert point["source"] and point["nodes"] >= 1
    if point["nodes"] == 1:  # a one-node point runs on part of a node: the node keeps its size
        assert point["gpus_per_node"] <= cfg.cluster.gpus_per_node
    else:  # the whole of each node, in one communicator
        assert cfg.cluster.nodes == point["nodes"] and cfg.cluster.gpus_per_node == point["gpus_per_node"]
    published = point["busbw_gbs"]
    published = sum(published) / 2 if isinstance(published, list) else published
    model = bus_gbs(cfg, point["nodes"] * point["gpus_per_node"], 1, 2.0)
    assert model == pytest.approx(published, rel=TOLERANCE), f"{point['id']}: model {model:.0f} GB/s"


def test_a_group_with_eight_ranks_per_node_crosses_over_eight_nics(compose):
    """NCCL's rings over nodes run a channel per NIC: a data-parallel group with all 8 GPUs of each
    node (tp=1) reaches 8 NICs' bandwidth, bounded by NVLink; one with a rank per node (stride 8,
    tp=8) reaches one NIC's. On DGX A100s the 8 HDR NICs (188 GB/s) stay under NVLink's 240."""
    a100 = compose("cluster=a100_cluster", "cluster.nodes=8")
    one_nic = bus_gbs(a100, 8, 8, 2.0)
    assert one_nic == pytest.approx(25 * NETWORK_EFFICIENCY)
    assert bus_gbs(a100, 64, 1, 2.0) == pytest.approx(8 * one_nic)
    assert bus_gbs(a100, 32, 2, 1.0) == pytest.approx(4 * one_nic)  # tp=2: 4 ranks per node, half the NICs each
    h100 = compose("cluster=h100_cluster", "cluster.nodes=8")
    assert bus_gbs(h100, 8, 8, 2.0) == pytest.approx(50 * NETWORK_EFFICIENCY)
    assert bus_gbs(h100, 64, 1, 2.0) == pytest.approx(min(450 * COLLECTIVE_EFFICIENCY, 8 * 50 * NETWORK_EFFICIENCY))
    # ~8x what the planner charged before (one NIC per GPU at the NVLink ring's efficiency)
    assert bus_gbs(h100, 64, 1, 2.0) / (50 * COLLECTIVE_EFFICIENCY) == pytest.approx(9.0)
    # ring_time's link is the bus bandwidth over its efficiency; a group inside a node keeps NVLink's line rate
    assert link_gbs(h100, 64, 1) == pytest.approx(bus_gbs(h100, 64, 1) / COLLECTIVE_EFFICIENCY)
    assert link_gbs(h100, 8, 1) == 450


def test_fewer_nics_than_gpus_are_shared(compose):
    """DGX-1 V100: 4 EDR NICs per 8 GPUs. The groups of a layout communicate at once, so a group with
    one rank per node gets half a NIC (the 6.25 GB/s per GPU the cluster file gave before it counted
    NICs), one with all 8 GPUs of each node the 4 NICs."""
    v100 = compose("cluster=v100_cluster")
    assert bus_gbs(v100, 4, 8) == pytest.approx(6.25 * NETWORK_EFFICIENCY)
    assert bus_gbs(v100, 32, 1) == pytest.approx(4 * 12.5 * NETWORK_EFFICIENCY)


def test_nvlink_and_infiniband_sharp_count_only_where_declared(compose):
    plain = compose("cluster=h100_cluster", "cluster.nodes=8")
    assert not plain.cluster.nvls and not plain.cluster.sharp
    assert bus_gbs(plain, 8, 1, 2.0) == pytest.approx(450 * COLLECTIVE_EFFICIENCY)  # the ring
    nvls = compose("cluster=h100_cluster", "cluster.nodes=8", "cluster.nvls=true")
    assert bus_gbs(nvls, 8, 1, 2.0) > 1.3 * bus_gbs(plain, 8, 1, 2.0)
    assert bus_gbs(nvls, 8, 1, 1.0) == bus_gbs(plain, 8, 1, 1.0)  # all-reduce only
    # IB SHARP: the switches reduce, each node sends its data once (a ring sends it about twice)
    a100 = compose("cluster=a100_cluster", "cluster.nodes=8")
    sharp = compose("cluster=a100_cluster", "cluster.nodes=8", "cluster.sharp=true")
    assert bus_gbs(sharp, 64, 1, 2.0) > 1.2 * bus_gbs(a100, 64, 1, 2.0)
    assert bus_gbs(sharp, 8, 8, 2.0) == pytest.approx(2 * 7 / 8 * bus_gbs(a100, 8, 8, 2.0))
    assert bus_gbs(sharp, 64, 1, 1.0) == bus_gbs(a100, 64, 1, 1.0)


def test_on_two_nodes_the_tree_halves_the_network_traffic(compose):
    """sjeaugey (NVIDIA/nccl#946): on 2 nodes NCCL's tree puts half the intra-node traffic on the
    network, up to ~2x the network speed where NVLink has room: DGX A100s, 8 HDR NICs."""
    two = compose("cluster=a100_cluster", "cluster.nodes=2")
    ring = min(300 * COLLECTIVE_EFFICIENCY, 8 * 25 * NETWORK_EFFICIENCY)
    assert bus_gbs(two, 16, 1, 1.0) == pytest.approx(ring)  # an all-gather runs the ring
    # the chain inside the node bounds it: each GPU sends twice the message, (n-1)/n of NVLink
    assert bus_gbs(two, 16, 1, 2.0) == pytest.approx(15 / 16 * 300 * COLLECTIVE_EFFICIENCY)
    assert bus_gbs(compose("cluster=a100_cluster", "cluster.nodes=4"), 32, 1, 2.0) == pytest.approx(ring)
