"""`parakit probe`: measure the machine at hand for the planner (toolkit/plan/perf.py).

The planner's CPU cluster is a handful of constants: how fast one rank multiplies matrices
(and how that falls for small shapes), how fast it streams memory, and what a collective among
local ranks costs. Guessed, they put the main job's predicted step 2-4x off; measured, they are
the machine's. Every rank of the probe runs with one thread, as training ranks do
(OMP_NUM_THREADS=1), and the compute is measured on as many ranks at once as there are cores,
so that the ranks contend for caches and memory as they do in training.

What is measured (raw figures, kept in the probe's file beside the constants fitted to them):
- GEMMs over a grid of shapes (M tokens x N outputs x K inputs, 16..1024), fp32 and bf16:
  torch.mm, the kernels torch's Linear layers run on CPU (oneDNN / MKL).
- Element-wise streaming: out = a + b over 256 KiB..128 MiB tensors (the STREAM "add" kernel,
  McCalpin 1995), 3 x 4 bytes per element, into a kept output and into a new one.
- The software stack: one rank of each backend trains the tiny model at a few sizes (layers,
  vocabulary), timing whole steps.
- Collectives through torch.distributed among the ranks (gloo on CPU): all-reduce, all-gather,
  reduce-scatter (where the backend has it) and point-to-point send/recv, 4 KiB..16 MiB.

The fit (toolkit/plan/machine_fit.py) turns them into cluster constants.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

GEMM_DIMS = (16, 64, 256, 1024)
GEMM_TOKENS = (64, 256, 1024)
STREAM_BYTES = (2**18, 2**20, 2**22, 2**24, 2**26, 2**27)  # 256 KiB .. 128 MiB per tensor
COLLECTIVE_BYTES = tuple(2**k for k in range(12, 25, 2))  # 4 KiB .. 16 MiB
# Each figure: 3 batches of calls, each at least this long, and the mean over all of them. Training
# feels the machine's average speed: on a shared VM the same single-thread GEMM ran anywhere from
# 26 to 98 GFLOP/s in 0.2 s windows over 40 s (median 56), so the fastest batch of a probe is up
# to 1.7x faster than a training step averages.
MIN_SECONDS = 0.05


def _timed(fn, min_seconds: float = MIN_SECONDS) -> float:
    """Seconds one call takes on average over 3 batches of calls, each at least min_seconds."""
    fn()  # warm: first-touch pages, oneDNN's kernel choice
    calls, started = 0, time.perf_counter()
    for batch in range(1, 4):
        while time.perf_counter() - started < batch * min_seconds:
            fn()
            calls += 1
    return (time.perf_counter() - started) / calls


def gemm_times(dtype) -> list[list[float]]:
    """[M, N, K, seconds] per shape of the grid."""
    import torch

    rows = []
    for m in GEMM_TOKENS:
        for n in GEMM_DIMS:
            for k in GEMM_DIMS:
                a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
                out = torch.empty(m, n, dtype=dtype)
                rows.append([m, n, k, _timed(lambda: torch.mm(a, b, out=out))])
    return rows


def stream_times() -> list[list[float]]:
    """[bytes moved, seconds in place, seconds fresh] of a + b -> out (fp32: two reads and a write
    per element) into a kept tensor and into a new one, as an out-of-place torch op allocates."""
    import torch

    rows = []
    for nbytes in STREAM_BYTES:
        a, b = torch.randn(nbytes // 4), torch.randn(nbytes // 4)
        out = torch.empty_like(a)
        rows.append([3 * nbytes, _timed(lambda: torch.add(a, b, out=out)), _timed(lambda: torch.add(a, b))])
    return rows


def _collective(kind: str, nbytes: int, group, peer: int | None):
    """A callable that runs one `kind` collective of nbytes per rank in `group` (for send_recv: one
    message to `peer` and one back)."""
    import torch
    import torch.distributed as dist

    x = torch.zeros(max(1, nbytes // 4))
    size = dist.get_world_size(group)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if kind == "all_gather":
        parts = [torch.empty_like(x) for _ in range(size)]
        return lambda: dist.all_gather(parts, x, group=group)
    if kind == "reduce_scatter":
        parts = [torch.empty_like(x) for _ in range(size)]
        return lambda: dist.reduce_scatter(x, parts, group=group)
    if kind == "send_recv":
        first = dist.get_rank() < peer

        def ping_pong():
            if first:
                dist.send(x, peer)
                dist.recv(x, peer)
            else:
                dist.recv(x, peer)
                dist.send(x, peer)

        return ping_pong
    raise ValueError(kind)


def _time_together(fn) -> float:
    """Seconds per call of a collective every rank runs: warm-up calls, then 3 batches of as many
    calls as rank 0 finds to take MIN_SECONDS; the mean over them (a collective ends on every rank
    at about the same time, so rank 0's figure stands for all)."""
    import torch
    import torch.distributed as dist

    for _ in range(2):
        fn()
    dist.barrier()
    started = time.perf_counter()
    fn()
    calls = torch.tensor([max(1, min(1000, int(MIN_SECONDS / max(time.perf_counter() - started, 1e-6))))])
    dist.broadcast(calls, 0)
    elapsed = 0.0
    for _ in range(3):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(int(calls)):
            fn()
        elapsed += time.perf_counter() - started
    return elapsed / (3 * int(calls))


def collective_times(rank: int, world: int) -> dict[str, dict[str, list[list[float]]]]:
    """group size -> kind -> [bytes per rank, seconds]: all ranks in one group, and (with 4 or more
    ranks) pairs of neighbours all at once, as tensor- and pipeline-parallel groups of 2 run."""
    import torch.distributed as dist

    groups = {world: (None, rank ^ 1 if (rank ^ 1) < world else None)}
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]  # every rank creates every group
    if world >= 4:
        groups[2] = (pairs[rank // 2] if rank // 2 < len(pairs) else None, None)
    out: dict[str, dict[str, list[list[float]]]] = {}
    for size, (group, peer) in groups.items():
        kinds = {}
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
            if kind == "send_recv" and (size != world or world % 2):
                continue  # point-to-point: every rank with its neighbour, once
            rows = []
            for nbytes in COLLECTIVE_BYTES:
                in_group = group is not None or size == world
                fn = _collective(kind, nbytes, group, peer) if in_group else (lambda: None)
                try:
                    seconds = _time_together(fn)
                except RuntimeError as e:  # gloo has no reduce_scatter
                    if "reduce_scatter" not in str(e).lower() and "not supported" not in str(e).lower():
                        raise
                    break
                rows.append([nbytes, seconds / (2 if kind == "send_recv" else 1)])
            if rows:
                kinds[kind] = rows
        out[str(size)] = kinds
    return out


def _rank_main(world: int, port: int, compute_ranks: int, rank: int, queue) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result: dict = {}
        dist.barrier()
        if rank < compute_ranks:  # the compute figures under the contention training has
            result["gemm_fp32"] = gemm_times(torch.float32)
            result["gemm_bf16"] = gemm_times(torch.bfloat16)
            result["stream"] = stream_times()
        dist.barrier()
        result["collectives"] = collective_times(rank, world)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if rank == 0:
            queue.put(gathered)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(target, args: tuple, world: int):
    """Spawn `world` processes target(*args, rank, queue) and return what rank 0 puts on the queue
    (every process joined, or killed after a minute)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, rank, queue)) for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        return queue.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


def measure(ranks: int, cores: int) -> dict:
    """Every rank's raw figures: compute on min(ranks, cores) ranks at once, collectives on all."""
    compute_ranks = max(1, min(ranks, cores))
    gathered = _run_ranks(_rank_main, (ranks, _free_port(), compute_ranks), ranks)
    return {"ranks": ranks, "compute_ranks": compute_ranks, "per_rank": gathered}


STACK_STEPS, STACK_WARMUP = 8, 2


def _stack_main(backend: str, points: list, world: int, port: int, rank: int, queue) -> None:
    """Seconds per step of each (layers, vocabulary, tp) point of `backend` on `world` ranks: the
    points in order, then in reverse, each time the median step after warm-up (as a training run's
    step is read), and the mean of its two (a slow minute of a shared VM then weighs on one of
    them, not on one point's figure alone); rank 0 reports."""
    import statistics

    import torch

    from toolkit.config.store import compose_config
    from toolkit.plan.backends import backend_of
    from toolkit.plan.layout import resolve
    from toolkit.plan.machine_fit import stack_overrides
    from toolkit.train.backends import trainer_module
    from toolkit.train.trainer import quiet_upstream_notices

    torch.set_num_threads(1)
    quiet_upstream_notices()
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    medians, kept = {}, None
    order = list(range(len(points)))
    for run, i in enumerate(order + order[::-1]):
        layers, vocab, tp = points[i]
        os.environ["MASTER_PORT"] = str(port + run)
        cfg = compose_config(stack_overrides(backend, layers, vocab, tp))
        steps = trainer_module(backend_of(cfg).name).setup(cfg, resolve(cfg))
        steps.begin_at(0)
        times = []
        for step in range(1, STACK_STEPS + 1):
            started = time.perf_counter()
            steps.forward_backward(step, False, lambda _step: None)
            steps.update()
            times.append(time.perf_counter() - started)
        medians.setdefault(i, []).append(statistics.median(times[STACK_WARMUP:]))
        if backend == "megatron":  # megatron-core rebuilds its groups each time
            steps.close()
        else:  # DeepSpeed keeps its groups past the process group's end: one group for all runs
            kept = steps
    if kept is not None:
        kept.close()
    if rank == 0:
        queue.put([statistics.fmean(medians[i]) for i in order])


def measure_stack(backend: str, points: list, world: int = 1) -> list[float]:
    return _run_ranks(_stack_main, (backend, points, world, _free_port()), world)


def probe(ranks: int) -> dict:
    """Measure, then fit: {"constants": ClusterConfig fields, "stack": backend -> StackCosts fields,
    "raw": the figures they came from, "seconds": how long it took}."""
    from toolkit.plan.backends import BACKENDS
    from toolkit.plan.machine_fit import STACK_POINTS, cluster_constants, fit_stack

    started = time.perf_counter()
    cores = len(os.sched_getaffinity(0))
    print(f"  matrix multiplies, memory streams and gloo collectives on {ranks} ranks ...", file=sys.stderr, flush=True)
    raw = measure(ranks, cores)
    constants = cluster_constants(raw)
    stack, raw["stack"] = {}, {}
    for backend, description in BACKENDS.items():
        print(f"  the {backend} stack on one rank ...", file=sys.stderr, flush=True)
        seconds = measure_stack(backend, [(*point, 1) for point in STACK_POINTS])
        if "tp" in description.parallel_dims and cores >= 2:  # tensor parallel's own layers, on 2 ranks
            seconds += measure_stack(backend, [(STACK_POINTS[1][0], STACK_POINTS[1][1], 2)], world=2)
        raw["stack"][backend] = seconds
        stack[backend] = fit_stack(backend, seconds, constants)
    return {"constants": constants, "stack": stack, "raw": raw, "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.train.machine_probe")
    parser.add_argument("--ranks", type=int, default=4, help="processes for the collectives (default 4)")
    parser.add_argument("--output", required=True)
    opts = parser.parse_args(argv)
    result = probe(opts.ranks)
    with open(opts.output, "w") as f:
        json.dump(result, f)
    print(f"  measured in {result['seconds']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
