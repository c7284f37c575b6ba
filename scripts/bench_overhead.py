"""What parakit's training loop costs: the step time of `parakit train` against a bare loop written
directly against the upstream API, on the same model, layout, data and number of steps.

    python scripts/bench_overhead.py                    # CPU: the tiny model, one gloo rank, both backends
    python scripts/bench_overhead.py --json             # the same, as one JSON object on stdout
    python scripts/bench_overhead.py --gpu              # llama3_1b, bf16, on one CUDA GPU
    python scripts/bench_overhead.py -- train.micro_batch=4   # further Hydra overrides after --

For each backend, each measurement is a fresh one-rank process (so that megatron-core's and
DeepSpeed's process-wide state never carries over), of one of two kinds:
- parakit: `toolkit.train.trainer.run(cfg, run_dir)`, the whole trainer as `parakit train` runs it
  (fault hooks, watchdog, NaN check, save schedule, metrics.jsonl/TensorBoard/console); its step
  times are the `step_time_s` of metrics.jsonl.
- bare: the loop written here. megatron-core: GPTModel built from the same configuration objects
  (toolkit.emit.megatron sections -> toolkit.train.megatron_configs -> megatron_model), then
  DistributedDataParallel, get_megatron_optimizer (the distributed optimizer at zero=1),
  OptimizerParamScheduler, get_forward_backward_func. DeepSpeed: the same transformers model
  (toolkit.train.deepspeed_engine.build_hf_model), deepspeed.initialize with the emitted JSON, the
  run's optimizer groups and learning-rate schedule, then engine(...), engine.backward,
  engine.step. Its batches are generated before the loop; the loop only moves them to the device.
Both start from the same weights and read the same synthetic tokens in the same order, so their
loss curves agree; the script checks that (`max_loss_difference`), which shows that both did the
same work.

A step's time runs from the end of the previous step to the end of this one, the span of
parakit's step_time_s: fetching data, forward/backward, the optimizer step, everything else the
loop does. The first --warmup steps of each process are dropped. `parakit_s` and `bare_s` are the
medians over the remaining steps of all repeats, `ratio` = parakit_s / bare_s (1.0: the loop costs
nothing; the goal is <= 1.03). Measurements alternate (parakit, bare, bare, parakit, ...) so that
a change in the machine's load hits both kinds; `runs` lists each process's median, the spread
between repeats: a ratio within that spread is noise.

On a CPU the processes run with one thread (--threads) and the same spans are also measured in
CPU time of the process (`cpu`: all its threads, the TensorBoard writer's included): on a shared
machine, wall time also counts the time other processes hold the cores, CPU time mostly not, so
the CPU-time ratio is the steadier one there. On a GPU, wall time is the measure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BACKENDS = ("megatron", "deepspeed")
KINDS = ("parakit", "bare")
CPU = [
    "model=tiny",
    "cluster=cpu",
    "precision=fp32",
    "train.global_batch=8",
    "train.micro_batch=2",
]
GPU = [
    "model=llama3_1b",
    "cluster=1xh200",
    "precision=bf16",
    "model.seq_length=2048",
    "train.global_batch=16",
    "train.micro_batch=4",
]
# One rank, plain data parallelism, the distributed optimizer / ZeRO-1, synthetic tokens, no saves.
COMMON = [
    "cluster.nodes=1",
    "cluster.gpus_per_node=1",
    "parallel=dp",
    "zero=1",
    "data=synthetic",
    "optim.warmup_steps=1",
]


# --- the workers (one process each) ----------------------------------------------------------


def _config(backend: str, overrides: list[str]):
    from toolkit.config.store import compose_config
    from toolkit.plan.validate import check

    cfg = compose_config([*overrides, f"backend={backend}"])
    layout, _ = check(cfg)
    if layout.world_size != 1:
        sys.exit(f"bench_overhead runs one rank; this layout needs {layout.world_size}")
    return cfg, layout


def _batches(cfg, layout, device) -> list[list[dict]]:
    """Every micro-batch of the run, made before the loop: step s, micro-batch j holds samples
    s*B + j*mb ... (one rank), sample i being the seq+1 tokens of default_rng([seed, i]), the
    order and tokens of toolkit.train.data.SyntheticTokens. Pinned on a GPU, for async copies."""
    import numpy as np
    import torch

    seq, mb = layout.seq_length, layout.micro_batch
    steps = []
    for step in range(layout.steps):
        micro = []
        for j in range(layout.grad_accum):
            first = step * layout.global_batch + j * mb
            text = np.stack(
                [
                    np.random.default_rng([cfg.train.seed, first + i]).integers(0, cfg.model.vocab_size, seq + 1)
                    for i in range(mb)
                ]
            )
            text = torch.from_numpy(text)
            batch = {
                "tokens": text[:, :-1].contiguous(),
                "labels": text[:, 1:].contiguous(),
                "loss_mask": torch.ones(mb, seq),
                "position_ids": torch.arange(seq).repeat(mb, 1),
            }
            micro.append({k: v.pin_memory() for k, v in batch.items()} if device.type == "cuda" else batch)
        steps.append(micro)
    return steps


def _init_process_group(backend: str) -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    torch.distributed.init_process_group(backend)  # one rank: RANK, WORLD_SIZE, MASTER_* from the parent


def parakit_worker(backend: str, overrides: list[str]) -> dict:
    import shutil

    from toolkit.train.trainer import quiet_upstream_notices, run

    quiet_upstream_notices()
    cfg, _ = _config(backend, overrides)
    cpu_clock = _clock_metrics_steps()
    run_dir = Path(tempfile.mkdtemp(prefix=f"parakit-bench-overhead-{backend}-"))
    try:
        run(cfg, run_dir)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "step_times": [r["step_time_s"] for r in records],
        "cpu_times": _differences(cpu_clock),
        "losses": [r["loss"] for r in records],
    }


def _clock_metrics_steps() -> list[float]:
    """The process's CPU time at each call of the trainer's Metrics.step, the instant at which
    it takes the wall time of step_time_s (a pass-through wrapper: no change to what runs)."""
    from toolkit.train.metrics import Metrics

    readings: list[float] = []
    step = Metrics.step

    def clocked(self, *args, **kwargs):
        readings.append(time.process_time())
        return step(self, *args, **kwargs)

    Metrics.step = clocked
    return readings


def _differences(readings: list[float]) -> list[float]:
    """Per-step spans from readings at the end of each step; the first step has none (nan)."""
    return [float("nan")] + [b - a for a, b in zip(readings, readings[1:])]


def bare_megatron(overrides: list[str]) -> dict:
    import torch

    from toolkit.train import mcore_cpu

    mcore_cpu.enable()  # megatron-core on the CPU (nothing with CUDA)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from toolkit.emit.megatron import megatron_sections
    from toolkit.train.megatron_configs import build_megatron_configs
    from toolkit.train.megatron_init import draw_layout_free
    from toolkit.train.megatron_model import build_model_chunks
    from toolkit.train.trainer import quiet_upstream_notices

    quiet_upstream_notices()
    cfg, layout = _config("megatron", overrides)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    _init_process_group("nccl" if cuda else "gloo")
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(cfg.train.seed)  # the seeds parakit sets, in its order: the same weights
    model_parallel_cuda_manual_seed(cfg.train.seed)
    sections = megatron_sections(cfg, layout)
    config, optimizer_config, ddp_config = build_megatron_configs(sections)
    (chunk,) = build_model_chunks(sections, config)
    draw_layout_free([chunk], cfg.train.seed)  # parakit's initial weights (any layout's)
    if config.bf16 or config.fp16:
        chunk = Float16Module(config, chunk)
    model = DistributedDataParallel(config, ddp_config, chunk)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(optimizer_config, [model])
    if config.fp16:
        config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(optimizer, **sections["scheduler"])
    forward_backward = get_forward_backward_func()
    batches = _batches(cfg, layout, device)

    def forward_step(data_iterator, model):
        batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        mask = batch["loss_mask"].reshape(-1).float()

        def loss_func(output):
            loss = torch.sum(output.float().reshape(-1) * mask) / mask.sum()
            return loss, {"lm loss": loss.detach().clone()}  # the schedule scales `loss` in place

        return output, loss_func

    step_times, cpu_clock, losses = [], [], []
    last = time.perf_counter()
    for micro_batches in batches:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        outputs = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=model,
            num_microbatches=layout.grad_accum,
            seq_length=layout.seq_length,
            micro_batch_size=layout.micro_batch,
            forward_only=False,
        )
        updated, _, _ = optimizer.step()
        if updated:
            scheduler.step(increment=1)
        losses.append(torch.stack([o["lm loss"] for o in outputs]).mean().item())
        now = time.perf_counter()
        cpu_clock.append(time.process_time())
        step_times.append(now - last)
        last = now
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return {"step_times": step_times, "cpu_times": _differences(cpu_clock), "losses": losses}


def bare_deepspeed(overrides: list[str]) -> dict:
    import importlib
    from functools import partial

    import torch
    import torch.nn.functional as F

    cuda = torch.cuda.is_available()
    if not cuda:  # skip DeepSpeed's shared-memory collective (a C++ build): gloo does every collective
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    from toolkit.emit.deepspeed import deepspeed_config
    from toolkit.plan.lr_schedule import lr_schedule
    from toolkit.train.deepspeed_engine import ScheduledLR, build_hf_model, optimizer_groups
    from toolkit.train.trainer import quiet_upstream_notices

    quiet_upstream_notices()
    cfg, layout = _config("deepspeed", overrides)
    _init_process_group("nccl" if cuda else "gloo")
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    torch.manual_seed(cfg.train.seed)
    ds_json = deepspeed_config(cfg, layout)
    model = build_hf_model(cfg, ds_json, deepspeed)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=optimizer_groups(model, cfg.optim.weight_decay),
        config=ds_json,
        lr_scheduler=partial(ScheduledLR, schedule=lr_schedule(cfg, layout)),
    )
    batches = _batches(cfg, layout, engine.device)

    step_times, cpu_clock, losses = [], [], []
    last = time.perf_counter()
    for micro_batches in batches:
        total = torch.zeros((), device=engine.device)
        for batch in micro_batches:
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            logits = engine(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits
            token_losses = F.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)), batch["labels"].reshape(-1), reduction="none"
            )
            mask = batch["loss_mask"].reshape(-1).float()
            loss = torch.sum(token_losses * mask) / mask.sum()
            engine.backward(loss)
            engine.step()  # an update at the accumulation boundary
            total += loss.detach().float()
        losses.append(total.item() / layout.grad_accum)
        now = time.perf_counter()
        cpu_clock.append(time.process_time())
        step_times.append(now - last)
        last = now
    torch.distributed.destroy_process_group()
    return {"step_times": step_times, "cpu_times": _differences(cpu_clock), "losses": losses}


def worker(name: str, out: Path, overrides: list[str]) -> int:
    backend, kind = name.split("-")
    if kind == "parakit":
        result = parakit_worker(backend, overrides)
    else:
        result = (bare_megatron if backend == "megatron" else bare_deepspeed)(overrides)
    out.write_text(json.dumps(result))
    return 0


# --- the driver ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(backend: str, kind: str, overrides: list[str], args, scratch: Path) -> dict:
    out = scratch / f"{backend}-{kind}-{time.monotonic_ns()}.json"
    command = [sys.executable, __file__, "--worker", f"{backend}-{kind}", "--out", str(out), "--", *overrides]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    if not args.gpu:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(args.threads))
    print(f"  {backend:9} {kind:7} ...", end="", file=sys.stderr, flush=True)
    started = time.monotonic()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0 or not out.exists():
        sys.exit(f"\n{backend} {kind} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    measured = json.loads(out.read_text())
    step = statistics.median(measured["step_times"][args.warmup :])
    print(f" {time.monotonic() - started:5.1f} s, median step {step:.4f} s", file=sys.stderr, flush=True)
    return measured


def _medians(runs: dict[str, list[dict]], key: str, warmup: int) -> dict:
    kept = {kind: [r[key][warmup:] for r in runs[kind]] for kind in KINDS}
    parakit_s = statistics.median(t for r in kept["parakit"] for t in r)
    bare_s = statistics.median(t for r in kept["bare"] for t in r)
    runs = {kind: [statistics.median(r) for r in kept[kind]] for kind in KINDS}
    return {"parakit_s": parakit_s, "bare_s": bare_s, "ratio": parakit_s / bare_s, "runs": runs}


def compare(runs: dict[str, list[dict]], warmup: int) -> dict:
    losses = [r["losses"] for kind in KINDS for r in runs[kind]]
    return {
        **_medians(runs, "step_times", warmup),
        "cpu": _medians(runs, "cpu_times", warmup),
        "steps_measured": len(runs["parakit"][0]["step_times"]) - warmup,
        "max_loss_difference": max(abs(a - b) for curve in losses[1:] for a, b in zip(losses[0], curve)),
    }


def _line(name: str, r: dict) -> str:
    spread = "; ".join(f"{kind} " + " ".join(f"{s:.4f}" for s in r["runs"][kind]) for kind in KINDS)
    return (
        f"{name:14} parakit {r['parakit_s']:.4f} s   bare {r['bare_s']:.4f} s   ratio {r['ratio']:.3f}   "
        f"(per process: {spread})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--gpu", action="store_true", help="llama3_1b in bf16 on one CUDA GPU")
    parser.add_argument("--steps", type=int, help="measured steps per process (default 20 on CPU, 30 on GPU)")
    parser.add_argument("--warmup", type=int, default=4, help="steps left out at the start of each process (>= 1)")
    parser.add_argument("--repeats", type=int, default=2, help="processes of each kind per backend")
    parser.add_argument("--threads", type=int, default=1, help="CPU: OMP_NUM_THREADS of every process")
    parser.add_argument("--backend", choices=BACKENDS, action="append", help="only this backend (repeatable)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="further Hydra overrides")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.out, args.overrides)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step's span includes start-up)")

    import torch

    if args.gpu and not torch.cuda.is_available():
        print("bench_overhead --gpu: no CUDA device here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    steps = args.warmup + (args.steps or (30 if args.gpu else 20))
    overrides = [*(GPU if args.gpu else CPU), *COMMON, f"train.steps={steps}", *args.overrides]
    backends = args.backend or list(BACKENDS)
    print(f"bench_overhead: {' '.join(overrides)}; {args.repeats} repeats", file=sys.stderr, flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="parakit-bench-overhead-") as scratch:
        for backend in backends:
            runs = {kind: [] for kind in KINDS}
            for repeat in range(args.repeats):
                for kind in KINDS if repeat % 2 == 0 else KINDS[::-1]:  # parakit, bare, bare, parakit, ...
                    runs[kind].append(measure(backend, kind, overrides, args, Path(scratch)))
            results[backend] = compare(runs, args.warmup)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    device = torch.cuda.get_device_name(0) if args.gpu else f"CPU, {os.cpu_count()} cores, {args.threads} thread(s)"
    print(
        f"\nmedian step time, {steps - args.warmup} steps x {args.repeats} processes after {args.warmup} warm-up "
        f"steps ({device}):"
    )
    for backend, r in results.items():
        print(f"  {_line(backend, r)}")
        print(f"  {_line('  (CPU time)', r['cpu'])}")
        agree = "agree" if r["max_loss_difference"] < 0.05 else "DIFFER (not the same work: the ratio means nothing)"
        print(f"  {'':14} losses of all processes {agree}: max difference {r['max_loss_difference']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
