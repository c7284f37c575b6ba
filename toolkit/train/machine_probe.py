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
import math
import os
import socket
import sys
import time
from dataclasses import dataclass

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


def _collective(kind: str, nbytes: int, group, peer: int | None, device: str = "cpu"):
    """A callable that runs one `kind` collective of nbytes per rank in `group` (for send_recv: one
    message to `peer` and one back), on tensors on `device` (NCCL: this rank's GPU)."""
    import torch
    import torch.distributed as dist

    x = torch.zeros(max(1, nbytes // 4), device=device)
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


def _time_together(fn, device: str = "cpu") -> float:
    """Seconds per call of a collective every rank runs: warm-up calls, then 3 batches of as many
    calls as rank 0 finds to take MIN_SECONDS; the mean over them (a collective ends on every rank
    at about the same time, so rank 0's figure stands for all). On a GPU NCCL's calls return once
    queued: each batch ends when the device has run them (nccl-tests times the same way: a batch of
    iterations, then a stream synchronize)."""
    import torch
    import torch.distributed as dist

    def done():
        if device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter()

    for _ in range(2):
        fn()
    done()
    dist.barrier()
    started = time.perf_counter()
    fn()
    one = done() - started
    calls = torch.tensor([max(1, min(1000, int(MIN_SECONDS / max(one, 1e-6))))], device=device)
    dist.broadcast(calls, 0)
    calls = int(calls.item())
    elapsed = 0.0
    for _ in range(3):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed += done() - started
    return elapsed / (3 * calls)


def collective_times(
    rank: int, world: int, device: str = "cpu", sizes: tuple[int, ...] = COLLECTIVE_BYTES
) -> dict[str, dict[str, list[list[float]]]]:
    """group size -> kind -> [bytes per rank, seconds]: all ranks in one group, and (with 4 or more
    ranks) pairs of neighbours all at once, as tensor- and pipeline-parallel groups of 2 run. The
    bytes are each rank's tensor: an all-reduce's whole, an all-gather's input and a
    reduce-scatter's output shard (the collective moves `size` of those)."""
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
            for nbytes in sizes:
                in_group = group is not None or size == world
                fn = _collective(kind, nbytes, group, peer, device) if in_group else (lambda: None)
                try:
                    seconds = _time_together(fn, device)
                except RuntimeError as e:  # gloo has no reduce_scatter
                    if "reduce_scatter" not in str(e).lower() and "not supported" not in str(e).lower():
                        raise
                    break
                rows.append([nbytes, seconds / (2 if kind == "send_recv" else 1)])
            if rows:
                kinds[kind] = rows
        out[str(size)] = kinds
    return out


def _gather_to_queue(result: dict, rank: int, world: int, queue) -> None:
    """(every rank of a probe's process group) Rank 0 puts every rank's `result`, in rank order, on `queue`."""
    import torch.distributed as dist

    gathered = [None] * world if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if rank == 0:
        queue.put(gathered)
    dist.barrier()


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
        _gather_to_queue(result, rank, world, queue)
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


def _stack_main(
    backend: str, points: list, world: int, port: int, cluster: list, passes: int, rank: int, queue
) -> None:
    """Seconds per step of each (layers, vocabulary, tp) point of `backend` on `world` ranks: the
    points in order, then (passes=2) in reverse, each time the median step after warm-up (as a
    training run's step is read), and the mean of its passes (a slow minute of a shared VM then
    weighs on one of them, not on one point's figure alone); rank 0 reports. `cluster`: the
    overrides that put the runs on a GPU (machine_fit.stack_overrides); on a GPU each step is timed
    to the end of its kernels (torch.cuda.synchronize)."""
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

    def now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    medians, kept = {}, None
    order = list(range(len(points)))
    for run, i in enumerate((order + order[::-1])[: passes * len(order)]):
        layers, vocab, tp = points[i]
        os.environ["MASTER_PORT"] = str(port + run)
        cfg = compose_config(stack_overrides(backend, layers, vocab, tp, cluster))
        steps = trainer_module(backend_of(cfg).name).setup(cfg, resolve(cfg))
        steps.begin_at(0)
        times = []
        for step in range(1, STACK_STEPS + 1):
            started = now()
            steps.forward_backward(step, False, lambda _step: None)
            steps.update()
            times.append(now() - started)
        medians.setdefault(i, []).append(statistics.median(times[STACK_WARMUP:]))
        if backend == "megatron":  # megatron-core rebuilds its groups each time
            steps.close()
        else:  # DeepSpeed keeps its groups past the process group's end: one group for all runs
            kept = steps
    if kept is not None:
        kept.close()
    if rank == 0:
        queue.put([statistics.fmean(medians[i]) for i in order])


def measure_stack(
    backend: str, points: list, world: int = 1, cluster: list | None = None, passes: int = 2
) -> list[float]:
    """Step seconds of `points` (see _stack_main), on this machine's CPU cluster or, with `cluster`,
    on the cluster those overrides compose (a GPU's datasheet file)."""
    return _run_ranks(_stack_main, (backend, points, world, _free_port(), list(cluster or []), passes), world)


def _say(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def stack_costs(
    constants: dict, tp_ranks: bool, cluster: list | None = None, passes: int = 2
) -> tuple[dict, dict, dict]:
    """Each backend's stack on one rank (and, where `tp_ranks`, tensor parallel's on two), fitted
    against `constants`: (backend -> StackCosts fields, backend -> the step seconds, what was left
    out and why). `cluster`: the overrides of a GPU's cluster (None: this machine's CPU one)."""
    from toolkit.plan.backends import BACKENDS
    from toolkit.plan.machine_fit import STACK_POINTS, fit_stack

    stack, seconds_of, skipped = {}, {}, {}
    where = "one GPU" if cluster else "one rank"
    for backend, description in BACKENDS.items():
        _say(f"the {backend} stack on {where} ...")
        seconds = measure_stack(backend, [(*point, 1) for point in STACK_POINTS], cluster=cluster, passes=passes)
        if "tp" in description.parallel_dims:
            if tp_ranks:  # tensor parallel's own layers, on 2 ranks
                tp_point = [(STACK_POINTS[1][0], STACK_POINTS[1][1], 2)]
                seconds += measure_stack(backend, tp_point, world=2, cluster=cluster, passes=passes)
            else:
                skipped[f"{backend}_tp_layer_s"] = (
                    f"tensor parallel's cost per layer needs two {'GPUs' if cluster else 'cores'}"
                )
        seconds_of[backend] = seconds
        stack[backend] = fit_stack(backend, seconds, constants, cluster)
    return stack, seconds_of, skipped


# The CPU probe's checkpoint write test: chunks of 64 MiB, each fsync'ed, for up to 1 GiB or 3 s.
CPU_WRITE = (2**30, 3.0, 2**26)


def probe(ranks: int, write_dir=".") -> dict:
    """Measure, then fit: {"constants": ClusterConfig fields, "stack": backend -> StackCosts fields,
    "raw": the figures they came from, "seconds": how long it took}."""
    from toolkit.plan.machine_fit import cluster_constants

    started = time.perf_counter()
    cores = len(os.sched_getaffinity(0))
    _say(f"matrix multiplies, memory streams and gloo collectives on {ranks} ranks ...")
    raw = measure(ranks, cores)
    _say(f"checkpoint writes into {os.path.abspath(write_dir)} ...")
    raw["write"] = write_bandwidth(write_dir, *CPU_WRITE)
    constants = cluster_constants(raw)
    stack, raw["stack"], _ = stack_costs(constants, tp_ranks=cores >= 2)
    return {"constants": constants, "stack": stack, "raw": raw, "seconds": time.perf_counter() - started}


# ---------------------------------------------------------------------------------------------
# GPUs: `parakit probe` on a CUDA machine. Every GPU of the node computes at once (as a node
# trains); rank 0's figures and the median over the GPUs go into the cluster file.


@dataclass(frozen=True)
class GpuSizes:
    """How much the GPU probe measures: well under a minute on one H100/H200 beside the stack runs
    (the tests drive the same code at toy sizes)."""

    square: int = 8192  # the large square bf16 GEMM (1.1 TFLOP: ~1.4 ms at 800 TFLOP/s)
    # it runs this long before any GEMM is timed: a matmul benchmark holds the GPU at its power
    # limit, below the clock a short burst reaches (stas00/ml-engineering, "Maximum Achievable
    # Matmul FLOPS": sustained, not burst, is what training sees)
    sustain_s: float = 1.0
    min_seconds: float = 0.02  # each of a figure's 3 batches of calls
    # (model, sequence length, micro batch) whose layers' GEMMs are timed: gpu_check's llama3_1b run
    models: tuple = (("llama3_1b", 2048, 2),)
    triad_bytes: int = 2**29  # per array of the triad: 1.5 GiB moved per call, far beyond any L2 (50-60 MB)
    dispatch_ops: int = 2000  # eager ops per batch of the dispatch figure (5 batches)
    write_bytes: int = 2**31  # the checkpoint write test stops at this many bytes ...
    write_seconds: float = 3.0  # ... or after this long, whichever comes first
    write_chunk: int = 2**26  # each chunk written, then fsync'ed
    collective_bytes: tuple = tuple(2**k for k in range(12, 29, 4))  # 4 KiB .. 256 MiB per rank


def _device_timed(fn, min_seconds: float) -> float:
    """Seconds per call of a kernel on the GPU: a pair of CUDA events around each batch of calls,
    read after the second completes (the device's own time for the batch, no host gaps between
    the kernels; as NVIDIA's CUDA best-practices guide, "Using CUDA GPU Timers", and triton's
    do_bench time kernels); one call sizes the batches, then the mean of 3 batches."""
    import torch

    fn()
    torch.cuda.synchronize()

    def batch(calls: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000  # milliseconds

    calls = max(1, min(10_000, math.ceil(min_seconds / max(batch(1), 1e-7))))
    return sum(batch(calls) for _ in range(3)) / (3 * calls)


def model_gemm_shapes(models) -> list[list[int]]:
    """[M, N, K] of the GEMMs a dense layer and the output layer of each (model, seq, micro batch)
    run at tp 1: every linear's forward (tokens x k @ k x n), its input gradient (tokens x n @ n x
    k) and its weight gradient (k x tokens @ tokens x n), as toolkit.plan.kernels.linear_time
    prices them."""
    from toolkit.config.schema import head_dim, kv_heads
    from toolkit.config.store import compose_config
    from toolkit.plan.layout import padded_vocab_size

    shapes: list[list[int]] = []
    for name, seq, micro in models:
        m = compose_config([f"model={name}", "cluster=1xh200"]).model  # any GPU cluster: the model alone is read
        tokens, h, d = seq * micro, m.hidden_size, head_dim(m)
        q, kv = m.num_attention_heads * d, kv_heads(m) * d
        ffn_in = m.ffn_hidden_size * (2 if m.activation == "swiglu" else 1)
        vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
        for n, k in ((q + 2 * kv, h), (h, q), (ffn_in, h), (h, m.ffn_hidden_size), (vocab, h)):
            for shape in ([tokens, n, k], [tokens, k, n], [k, n, tokens]):
                if shape not in shapes:
                    shapes.append(shape)
    return shapes


def gemm_times_gpu(shapes: list[list[int]], device: str, sizes: GpuSizes) -> dict:
    """bf16 torch.mm (cuBLAS) per shape: {"gemm_bf16": [M, N, K, seconds] rows, the square one
    last; "square_fp32": the same square in fp32}. The square first runs sizes.sustain_s."""
    import torch

    def timed(m, n, k, dtype=torch.bfloat16, sustain=0.0):
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        out = torch.empty(m, n, dtype=dtype, device=device)
        started = time.perf_counter()
        while time.perf_counter() - started < sustain:
            torch.mm(a, b, out=out)
            torch.cuda.synchronize()  # the loop's seconds are the GPU's, not a queue's
        return [m, n, k, _device_timed(lambda: torch.mm(a, b, out=out), sizes.min_seconds)]

    s = sizes.square
    square = timed(s, s, s, sustain=sizes.sustain_s)  # also warms the chip for the shapes after it
    rows = [timed(*shape) for shape in shapes if shape != [s, s, s]]
    return {"gemm_bf16": rows + [square], "square_fp32": timed(s, s, s, torch.float32)}


def triad_time(device: str, nbytes: int, min_seconds: float) -> list[float]:
    """[bytes moved, seconds] of STREAM's triad a = b + q*c (McCalpin 1995; BabelStream's "Triad"
    on GPUs, the figure conf/cluster files quote): one torch.add kernel over fp32 arrays of nbytes
    each, two read and one written."""
    import torch

    n = nbytes // 4
    a, b, c = torch.empty(n, device=device), torch.rand(n, device=device), torch.rand(n, device=device)
    return [3 * n * 4, _device_timed(lambda: torch.add(b, c, alpha=3.0, out=a), min_seconds)]


def dispatch_time(device: str, ops: int) -> dict:
    """Host seconds to issue one eager op where the host, not the GPU, is the bottleneck: `ops`
    additions in a row on an 8-element tensor, timed on the host's clock from a synchronized
    device to a final synchronize, divided by the ops. A kernel this small runs in a few
    microseconds, less than its issue takes, so the GPU waits on the host and the wall time is the
    issuing's (overhead-bound: H. He, "Making Deep Learning Go Brrrr From First Principles",
    section "Overhead"; the 5-25 us per op ClusterConfig.op_dispatch_s cites). With autograd
    recording, as a training forward runs: the op_dispatch_s figure; without it, for reference.
    The median of 5 batches."""
    import statistics

    import torch

    def per_op(x) -> float:
        y = x
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(ops):
            y = y + 1.0
        torch.cuda.synchronize()
        return (time.perf_counter() - started) / ops

    tracked = torch.zeros(8, device=device, requires_grad=True)
    plain = torch.zeros(8, device=device)
    per_op(tracked)  # warm: the allocator's blocks, the kernel loaded
    return {
        "autograd_s": statistics.median(per_op(tracked) for _ in range(5)),
        "no_grad_s": statistics.median(per_op(plain) for _ in range(5)),
    }


def write_bandwidth(directory, total: int, seconds: float, chunk: int) -> dict:
    """{"bytes", "seconds"}: how fast `directory`'s filesystem takes a stream of writes made
    durable, as a checkpoint's: chunks of incompressible bytes, each written and fsync'ed (dd's
    `oflag=dsync` / fio's `fsync=1`: the page cache cannot absorb them), until `total` bytes or
    `seconds`, into a temporary file that is removed after."""
    import tempfile

    block = memoryview(os.urandom(chunk))
    written, fd = 0, None
    with tempfile.TemporaryDirectory(dir=directory, prefix=".parakit-write-probe-") as tmp:
        fd = os.open(os.path.join(tmp, "data"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            started = time.perf_counter()
            while written < total and (written == 0 or time.perf_counter() - started < seconds):
                view = block
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
                written += chunk
            elapsed = time.perf_counter() - started
        finally:
            os.close(fd)
    return {"bytes": written, "seconds": elapsed, "chunk": chunk, "directory": os.path.abspath(directory)}


def gpu_compute(device: str, shapes: list[list[int]], sizes: GpuSizes, say=_say) -> dict:
    """One GPU's figures: GEMMs, the HBM triad, the eager op's dispatch time."""
    import torch

    say(f"bf16 GEMMs: {sizes.square}^3 after {sizes.sustain_s:.0f} s of it, then {len(shapes)} shapes of the model ...")
    result = gemm_times_gpu(shapes, device, sizes)
    say("HBM bandwidth (STREAM triad) and the host time per eager op ...")
    result["triad"] = triad_time(device, sizes.triad_bytes, sizes.min_seconds)
    result["dispatch"] = dispatch_time(device, sizes.dispatch_ops)
    torch.cuda.empty_cache()
    return result


def _gpu_rank_main(world: int, port: int, shapes: list, sizes: GpuSizes, rank: int, queue) -> None:
    """One GPU of the node: its compute figures (all GPUs at once), then NCCL's collectives."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = gpu_compute(f"cuda:{rank}", shapes, sizes, say=_say if rank == 0 else (lambda line: None))
        dist.barrier()
        if rank == 0:
            _say(f"NCCL all-reduce, all-gather, reduce-scatter and send/recv among the {world} GPUs ...")
        result["collectives"] = collective_times(rank, world, f"cuda:{rank}", sizes.collective_bytes)
        _gather_to_queue(result, rank, world, queue)
    finally:
        dist.destroy_process_group()


def probe_gpu(write_dir, sizes: GpuSizes = GpuSizes(), device: str = "cuda") -> dict:
    """Measure this machine's GPUs, then fit: {"device": "cuda", "constants": ClusterConfig
    fields, "stack", "raw", "skipped": what was not measured and why, "seconds"}. `device` places
    the tensors (tests: "cpu", with torch.cuda patched); timings are CUDA events and syncs."""
    import torch

    from toolkit.config.store import compose_config, datasheet_cluster
    from toolkit.plan.machine_fit import gpu_constants
    from toolkit.train.capabilities import importable

    started = time.perf_counter()
    count, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    properties = torch.cuda.get_device_properties(0)
    base = datasheet_cluster(name)
    gpu = {
        "name": name,
        "count": count,
        "sm_count": properties.multi_processor_count,
        "memory_gb": properties.total_memory / 1e9,
        "datasheet": base,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    _say(f"{count} x {name} ({gpu['sm_count']} SMs); datasheet: {base or 'none matches: peaks measured'}")
    shapes = model_gemm_shapes(sizes.models)
    skipped = {}
    if count >= 2:
        per_rank = _run_ranks(_gpu_rank_main, (count, _free_port(), shapes, sizes), count)
    else:
        per_rank = [gpu_compute(device, shapes, sizes)]
        skipped["collectives"] = (
            "one GPU: no NCCL collective to measure (intra_node_bandwidth_gbs, collective_latency_s and the "
            "p2p figures stay the datasheet's)"
        )
    raw = {"gpu": gpu, "per_rank": per_rank, "shapes": shapes, "models": [list(m) for m in sizes.models]}
    raw["transformer_engine"] = importable("transformer_engine.pytorch")  # as megatron-core's HAVE_TE imports it
    _say(f"checkpoint write bandwidth of {os.path.abspath(write_dir)} ({sizes.write_seconds:.0f} s at most) ...")
    raw["write"] = write_bandwidth(write_dir, sizes.write_bytes, sizes.write_seconds, sizes.write_chunk)
    datasheet = compose_config([f"cluster={base or FALLBACK_DATASHEET}"]).cluster
    constants = gpu_constants(raw, datasheet, measured_peaks=base is None)
    # the stack on the GPU, in bf16, once per point (no shared VM's minutes to average out)
    cluster = [f"cluster={base or FALLBACK_DATASHEET}", "precision=bf16"]
    stack, raw["stack"], stack_skipped = stack_costs(constants, tp_ranks=count >= 2, cluster=cluster, passes=1)
    skipped.update(stack_skipped)
    return {
        "device": "cuda",
        "constants": constants,
        "stack": stack,
        "raw": raw,
        "skipped": skipped,
        "seconds": time.perf_counter() - started,
    }


# A GPU no conf/cluster file describes gets 1xh200's file as the template of its cluster, with
# the peaks it measured (gemm_efficiency against them) and its own memory.
FALLBACK_DATASHEET = "1xh200"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.train.machine_probe")
    parser.add_argument("--ranks", type=int, default=4, help="processes for the collectives (default 4)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: this machine's GPUs")
    parser.add_argument("--write-dir", default=".", help="whose filesystem's checkpoint write bandwidth is measured")
    parser.add_argument("--output", required=True)
    opts = parser.parse_args(argv)
    result = probe_gpu(opts.write_dir) if opts.device == "cuda" else probe(opts.ranks, opts.write_dir)
    with open(opts.output, "w") as f:
        json.dump(result, f)
    _say(f"measured in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
