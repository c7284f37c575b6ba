"""Data-parallel traffic measured against the planner: the collectives of one step's gradient
reduction and parameter gathering, for each comm setting, timed on this machine's ranks beside the
step-time model's figure for the same configuration (and each setting's ratio to the flat one,
measured and predicted).

    python scripts/bench_comm.py [--ranks 4] [--params 4e6] [--repeats 15] [--json OUT]

The collectives are those the backends issue, through torch.distributed's gloo on this machine's
CPU ranks (NCCL needs a GPU per rank, which no machine lent to this project has), on a buffer of
--params parameters:
  megatron flat            the distributed optimizer: gradients reduce-scattered over the ranks, the
                           updated parameters all-gathered (megatron-core param_and_grad_buffer.py,
                           start_grad_sync / start_param_sync)
  megatron 2 instances     comm.optimizer_instances=2: reduce-scatter inside each half of the ranks,
                           the half's shard all-reduced across the halves, all-gather inside each half
  megatron bf16 reduce     precision=bf16 precision.grad_reduce_in_fp32=false: the same in 16 bits
  deepspeed ZeRO-3         one micro-batch: the parameters all-gathered for the forward and again for
                           the backward, the gradients reduce-scattered (runtime/zero/stage3.py)
  deepspeed ZeRO-3 hpZ     comm.hpz_partition_size=2: the backward's all-gather inside groups of 2
The planner's figure is toolkit.plan.perf.data_parallel_comm for that configuration on the default
cluster (the constants `parakit probe` measured), with the overlap off (all of it exposed), one
micro-batch. Each measured figure is the slowest rank's median over --repeats, the settings taken
in turn (round-robin) after two warm-up steps each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SETTINGS = {
    "megatron flat": ["backend=megatron", "zero=1", "precision=fp32"],
    "megatron 2 instances": ["backend=megatron", "zero=1", "precision=fp32", "comm.optimizer_instances=2"],
    "megatron bf16 reduce": ["backend=megatron", "zero=1", "precision=bf16", "precision.grad_reduce_in_fp32=false"],
    "deepspeed ZeRO-3": ["backend=deepspeed", "zero=3", "precision=fp32"],
    "deepspeed ZeRO-3 hpZ 2": ["backend=deepspeed", "zero=3", "precision=fp32", "comm.hpz_partition_size=2"],
}
BASELINE = {"megatron": "megatron flat", "deepspeed": "deepspeed ZeRO-3"}


def _groups(world: int, size: int) -> tuple[object, object]:
    """(this rank's group of `size` consecutive ranks, its group of the ranks at the same place
    in every such group); every rank creates every group (new_group is collective)."""
    rank = dist.get_rank()
    inside = [dist.new_group(list(range(g, g + size))) for g in range(0, world, size)]
    across = [dist.new_group(list(range(i, world, size))) for i in range(size)]
    return inside[rank // size], across[rank % size]


def _step(name: str, params: int, world: int, groups: dict):
    """The collectives of one step of setting `name`, as a function to time."""
    shard = params // world
    if name.startswith("megatron"):
        dtype = torch.bfloat16 if "bf16" in name else torch.float32
        grads, params_ = torch.ones(params, dtype=dtype), torch.ones(params, dtype=dtype)
        if "instances" in name:
            inside, across = groups[2]
            part = torch.empty(params // 2, dtype=dtype)

            def two_level():
                dist.reduce_scatter_single(part, grads, group=inside)
                dist.all_reduce(part, group=across)
                dist.all_gather_single(params_, part, group=inside)

            return two_level
        part = torch.empty(shard, dtype=dtype)

        def flat():
            dist.reduce_scatter_single(part, grads)
            dist.all_gather_single(params_, part)

        return flat
    full, grads, part = torch.ones(params), torch.ones(params), torch.empty(shard)
    secondary = groups[2][0] if "hpZ" in name else None
    half = torch.empty(params // 2)

    def zero3():
        dist.all_gather_single(full, part)  # forward: from the primary partition over all ranks
        if secondary is None:
            dist.all_gather_single(full, part)  # backward: again
        else:  # backward: from hpZ's secondary partition, inside the group
            dist.all_gather_single(full, half, group=secondary)
        dist.reduce_scatter_single(part, grads)

    return zero3


def _worker(rank: int, world: int, port: int, params: int, repeats: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    groups = {2: _groups(world, 2)}
    steps = {name: _step(name, params, world, groups) for name in SETTINGS}
    for step in steps.values():  # warm-up: buffers touched, groups connected
        step()
        step()
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(repeats):  # round-robin: the machine's drift falls on every setting alike
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    queue.put((rank, {name: statistics.median(t) for name, t in times.items()}))
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, params: int, repeats: int) -> dict[str, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(world, port, params, repeats, queue), nprocs=world, start_method="spawn")
    per_rank = [queue.get() for _ in range(world)]
    return {name: max(times[name] for _, times in per_rank) for name in SETTINGS}


def predict(world: int, params: int) -> dict[str, float]:
    from toolkit.config.store import compose_config
    from toolkit.plan.backends import backend_of
    from toolkit.plan.layout import resolve
    from toolkit.plan.perf import data_parallel_comm

    out = {}
    for name, overrides in SETTINGS.items():
        one_step = [f"cluster.gpus_per_node={world}", f"train.global_batch={world}", "train.micro_batch=1"]
        cfg = compose_config([*overrides, *one_step, "zero.overlap_comm=false"])
        out[name] = data_parallel_comm(cfg, resolve(cfg), backend_of(cfg), params, per_microbatch=0.0)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4, help="ranks (an even number: hpZ and instances halve them)")
    parser.add_argument("--params", type=float, default=4e6, help="parameters whose gradients travel")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()
    if args.ranks < 4 or args.ranks % 2:
        parser.error("--ranks must be an even number >= 4 (hpZ and the instances split them in halves)")
    params = int(args.params) // args.ranks * args.ranks
    measured, predicted = measure(args.ranks, params, args.repeats), predict(args.ranks, params)
    print(f"{params:,} parameters on {args.ranks} ranks (gloo, CPU)")
    print(f"{'setting':24} {'measured s':>11} {'planner s':>10} {'error':>7} {'vs flat: measured':>18} {'planner':>8}")
    rows = []
    for name in SETTINGS:
        base = BASELINE[name.split()[0]]
        row = {
            "setting": name,
            "overrides": SETTINGS[name],
            "measured_s": measured[name],
            "predicted_s": predicted[name],
            "error": predicted[name] / measured[name] - 1,
            "measured_ratio": measured[name] / measured[base],
            "predicted_ratio": predicted[name] / predicted[base],
        }
        rows.append(row)
        print(
            f"{name:24} {row['measured_s']:>11.4f} {row['predicted_s']:>10.4f} {row['error']:>+7.0%} "
            f"{row['measured_ratio']:>18.2f} {row['predicted_ratio']:>8.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
