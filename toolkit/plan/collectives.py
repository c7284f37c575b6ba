"""Time of one collective or point-to-point send between GPUs, and of communication that hides
under compute: the planner's communication primitives (the step's terms in toolkit.plan.perf use
them)."""

from __future__ import annotations

from toolkit.config.schema import Config

# NCCL reaches about 80% of link bandwidth for large messages (nccl-tests bus bandwidth on
# NVLink and InfiniBand NDR).
COLLECTIVE_EFFICIENCY = 0.8
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


def link_gbs(cfg: Config, group_size: int, stride: int) -> float:
    """The bandwidth such a group communicates over: the node's links, or the network between nodes."""
    c = cfg.cluster
    return c.inter_node_bandwidth_gbs if spans_nodes(cfg, group_size, stride) else c.intra_node_bandwidth_gbs


def all_to_all_time(cfg: Config, nbytes: float, group: int, stride: int) -> float:
    """An all-to-all in which each of `group` ranks (`stride` apart) sends nbytes, an equal share to
    each rank (its own share stays): every pair at once (NCCL's grouped send/recv), the shares to
    ranks of the same node over its links and the others over the network, whichever is slower."""
    if group <= 1:
        return 0.0
    c = cfg.cluster
    in_node = max(1, min(group, c.gpus_per_node // stride))  # the group's ranks on one node
    on_node, off_node = (in_node - 1) / group * nbytes, (group - in_node) / group * nbytes
    wire = max(
        on_node / (c.intra_node_bandwidth_gbs * 1e9 * COLLECTIVE_EFFICIENCY),
        off_node / (c.inter_node_bandwidth_gbs * 1e9 * COLLECTIVE_EFFICIENCY),
    )
    return c.collective_latency_s + wire
