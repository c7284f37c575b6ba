"""Time of one collective or point-to-point send between GPUs, and of communication that hides
under compute: the planner's communication primitives (the step's terms in toolkit.plan.perf use
them).

A collective's bandwidth is the bus bandwidth nccl-tests reports for it (nccl-tests
doc/PERFORMANCE.md: busbw = algbw * 2(n-1)/n for an all-reduce, algbw * (n-1)/n for an all-gather
or a reduce-scatter), what the same operation would need per GPU on a flat fabric: bus_gbs models
it from the links each algorithm NCCL runs loads, link_gbs hands it to ring_time."""

from __future__ import annotations

from toolkit.config.schema import ClusterConfig, Config

# NCCL's rings reach about 80% of NVLink's line rate (nccl-tests busbw 365-370 GB/s of NVLink 4's 450
# on 2-8 H100s with NCCL_ALGO=RING, NVIDIA/nccl#1455 and nccl-tests#212; 231.6 of NVLink 3's 300 on
# 8 A100s, Azure/AI-benchmarking-guide ND_A100_v4_results.md).
COLLECTIVE_EFFICIENCY = 0.8
# A NIC carries about 94% of its line rate under NCCL: 46-48 GB/s per 400 Gb/s NDR port, 24 of an HDR
# port's 25 (NVIDIA's NCCL maintainers in NVIDIA/nccl-tests#290 and #160).
NETWORK_EFFICIENCY = 0.94
# NVLink SHARP moves data at 0.85 of what the ring's copies reach (NCCL's own cost model,
# src/graph/tuning.cc nvlsEfficiency, Hopper).
NVLS_EFFICIENCY = 0.85
# Communication overlapped with compute still slows it: NCCL kernels occupy SMs and memory
# bandwidth (Jangda et al. 2022, "Breaking the Computation and Communication Abstraction
# Barrier in Distributed Machine Learning Workloads", section 2): charge 20% of the overlap.
OVERLAP_INTERFERENCE = 0.2


def ring_time(nbytes: float, group: int, bandwidth_gbs: float, factor: float, latency_s: float) -> float:
    """A ring collective in the alpha-beta model (Thakur, Rabenseifner & Gropp 2005, "Optimization of
    Collective Communication Operations in MPICH", section 4): factor*(g-1) steps of latency, and
    factor*(g-1)/g of nbytes per GPU over the link (factor 2 for all-reduce, 1 for all-gather and
    reduce-scatter)."""
    if group <= 1:
        return 0.0
    wire = factor * (group - 1) / group * nbytes / (bandwidth_gbs * 1e9 * COLLECTIVE_EFFICIENCY)
    return factor * (group - 1) * latency_s + wire


def p2p_time(cfg: Config, nbytes: float, link_gbs: float) -> float:
    """One point-to-point send of nbytes: the cluster's p2p latency, over its p2p bandwidth (the
    link's where none is given)."""
    bandwidth = cfg.cluster.p2p_bandwidth_gbs or link_gbs
    return cfg.cluster.p2p_latency_s + nbytes / (bandwidth * 1e9 * COLLECTIVE_EFFICIENCY)


def overlapped(comm: float, window: float) -> float:
    """Time a communication adds when it may hide under `window` seconds of compute."""
    hidden = min(comm, max(window, 0.0))
    return comm - hidden + OVERLAP_INTERFERENCE * hidden


def spans_nodes(cfg: Config, group_size: int, stride: int) -> bool:
    """Whether a group of `group_size` ranks `stride` apart (the rank order's inner dimensions)
    leaves one node."""
    return group_size > 1 and group_size * stride > cfg.cluster.gpus_per_node


def ranks_per_node(cfg: Config, group_size: int, stride: int) -> int:
    """How many of such a group's ranks share a node."""
    return max(1, min(group_size, cfg.cluster.gpus_per_node // stride))


def nic_gbs(c: ClusterConfig) -> float:
    """The network bandwidth one GPU reaches through NCCL: its share of the node's NICs (a NIC per GPU
    on a rail-optimised fabric) at NETWORK_EFFICIENCY. Every GPU of a node sends at once (the other
    groups of a layout communicate in step), so a share is what each gets."""
    return c.inter_node_bandwidth_gbs * (c.nics_per_node or c.gpus_per_node) / c.gpus_per_node * NETWORK_EFFICIENCY


def bus_gbs(cfg: Config, group_size: int, stride: int, factor: float = 1.0) -> float:
    """The bus bandwidth (nccl-tests' busbw) of a large collective over a group of `group_size` ranks
    `stride` apart, `factor` 2 for an all-reduce (1: an all-gather or a reduce-scatter), as NCCL
    runs it: the fastest of its algorithms, each bounded by the links it loads most (per GPU inside
    a node, per node across nodes), with volumes in multiples of the message.

    A ring inside a node moves 2(n-1)/n of it per GPU over NVLink. Across nodes with r ranks per
    node, NCCL runs flat rings, one per channel, each entering the node through a NIC, passing the
    node's GPUs over NVLink and leaving through a NIC, as many at once as the NICs allow
    (sjeaugey in NVIDIA/nccl#412 and #471; "on 3+ nodes [the all-reduce's busbw] is reflecting the
    total NIC bandwidth", NVIDIA/nccl-tests#160): the r ranks' NICs carry 2(n-1)/n of it, so
    busbw = min(NVLink, the r GPUs' share of the NICs). On two nodes NCCL's tree sends
    half as much over the network as inside the node (sjeaugey, NVIDIA/nccl#946): 2x per GPU on the
    intra-node chain, 1x per node on the network. NVLink SHARP (cluster.nvls) reduces in the switch:
    (1 + 1/r)x per GPU (multimem reduce of the GPU's share, store of the result to all), and across
    nodes NVLSTree's network tree (1x on two nodes, 2x beyond). IB SHARP (cluster.sharp): the network
    reduces, 1x per node, after a reduce-scatter in the node and before an all-gather."""
    c = cfg.cluster
    nvlink = c.intra_node_bandwidth_gbs * COLLECTIVE_EFFICIENCY
    r = ranks_per_node(cfg, group_size, stride)
    all_reduce = factor == 2.0
    if group_size <= r:  # inside one node
        if all_reduce and c.nvls:  # NVLS where it beats the ring (5 or more GPUs)
            return max(nvlink, _all_reduce_busbw(group_size, (1 + 1 / group_size) / (nvlink * NVLS_EFFICIENCY)))
        return nvlink
    network = r * nic_gbs(c)  # the r GPUs' share of the node's NICs
    best = min(nvlink, network) if r > 1 else network  # the rings
    if not all_reduce:
        return best
    two_nodes = group_size <= 2 * r
    if two_nodes and r > 1:  # the tree: a chain inside the node, half its traffic on the network
        best = max(best, _all_reduce_busbw(group_size, max(2 / nvlink, 1 / network)))
    if c.nvls and r > 1:  # NVLSTree: NVLS inside the node, the tree across nodes
        inside = (1 + 1 / r) / (nvlink * NVLS_EFFICIENCY)
        best = max(best, _all_reduce_busbw(group_size, max(inside, (1 if two_nodes else 2) / network)))
    if c.sharp:  # CollNet: reduce-scatter in the node, the switches reduce, all-gather in the node
        best = max(best, _all_reduce_busbw(group_size, max(2 * (r - 1) / r / nvlink, 1 / network)))
    return best


def _all_reduce_busbw(n: int, seconds_per_gb: float) -> float:
    """The bus bandwidth of an all-reduce over n ranks that takes `seconds_per_gb` per GB of its
    message: algbw * 2(n-1)/n (nccl-tests doc/PERFORMANCE.md)."""
    return 2 * (n - 1) / n / seconds_per_gb


def link_gbs(cfg: Config, group_size: int, stride: int, factor: float = 1.0) -> float:
    """The bandwidth ring_time charges such a group's collective at: its bus bandwidth, over the
    efficiency ring_time applies (the node's line rate for a group inside one node)."""
    return bus_gbs(cfg, group_size, stride, factor) / COLLECTIVE_EFFICIENCY


def send_gbs(cfg: Config, group_size: int, stride: int) -> float:
    """The bandwidth p2p_time charges a send between neighbours of such a group at: the node's links,
    or the sender's share of the node's NICs (over the efficiency p2p_time applies)."""
    c = cfg.cluster
    if not spans_nodes(cfg, group_size, stride):
        return c.intra_node_bandwidth_gbs
    return nic_gbs(c) / COLLECTIVE_EFFICIENCY


def all_to_all_time(cfg: Config, nbytes: float, group: int, stride: int) -> float:
    """An all-to-all in which each of `group` ranks (`stride` apart) sends nbytes, an equal share to
    each rank (its own share stays): every pair at once (NCCL's grouped send/recv), the shares to
    ranks of the same node over its links and the others over the GPU's share of the NICs (an
    all-to-all "cannot aggregate the bandwidth of multiple NICs", sjeaugey in
    NVIDIA/nccl-tests#267), whichever is slower."""
    if group <= 1:
        return 0.0
    c = cfg.cluster
    in_node = ranks_per_node(cfg, group, stride)
    on_node, off_node = (in_node - 1) / group * nbytes, (group - in_node) / group * nbytes
    wire = max(on_node / (c.intra_node_bandwidth_gbs * 1e9 * COLLECTIVE_EFFICIENCY), off_node / (nic_gbs(c) * 1e9))
    return c.collective_latency_s + wire
