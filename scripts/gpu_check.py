"""The first run on a GPU: what parakit measures on one NVIDIA GPU beside what its planner predicts,
in one JSON file, each step under its own timeout (about 11 minutes in all: with 15 minutes of
device time, `--only` a few steps at a time).

    bash scripts/gpu_check.sh                 # on the GPU machine: installs .whl/ first (scripts/build_gpu_wheels.sh)
    python scripts/gpu_check.py --cpu         # the same steps at toy size on CPU (the tests run it)

Steps, in order (a step that fails or times out is recorded as such; the next ones still run):
1. environment: the GPU, torch and CUDA, whether Transformer Engine, apex and flash-attn import,
   DeepSpeed's version, nvcc (megatron-core's own HAVE_TE is in the megatron run's kernels).
1b. probe: `parakit probe -o OUT/probe --name probed`: on a GPU its bf16 GEMM rate over llama3_1b's
   shapes, HBM bandwidth, the host's time per eager op, each backend's stack on one GPU, the
   checkpoint write bandwidth of OUT's filesystem, NCCL with 2+ GPUs (about a minute), written as
   the cluster file OUT/probe/cluster/probed.yaml; on CPU this machine's cached probe.
2. megatron: llama3_1b in bf16 (the distributed optimizer), 12 steps saved at step 6; a second
   process resumes from that checkpoint: its steps 7-12 must equal the first run's. The save's
   size, seconds, throughput and peak extra host memory and the load's seconds are recorded; its
   time limit follows the planner's save and step times on the probed filesystem (megatron_budget).
3. deepspeed ZeRO-1 and ZeRO-3: the same model and batch in bf16.
3b. kernels: both backends with train.kernels=reference and auto (on a GPU the fused kernels: Liger's
   RMSNorm, RoPE, SwiGLU and fused linear cross-entropy on DeepSpeed, megatron-core's fusions and
   fused cross-entropy on megatron) at sequence 4096, micro-batch 4 (2 where the reference kernels
   do not fit the card), global batch 32, 10 steps: step
   time, MFU and memory of each, and the largest loss difference between the two at any step.
3c. out_of_memory: a megatron run past the device (llama3_1b at micro-batch 64; on CPU the
   train.fault.oom drill) must exit 1 with the report and, on a GPU, the allocator's snapshot.
4. bench_overhead: parakit's loop against a bare megatron-core loop (scripts/bench_overhead.py).
5. fused_adam_build: how long DeepSpeed's FusedAdam takes to JIT-compile here (parakit's GPU runs
   use torch's fused AdamW instead, which needs no build).
For every training run: median step time, tokens/s and MFU after the warm-up steps (the two
profiled steps left out: their summary says how long the GPU was busy, by kernel kind, and how long
it waited for the host; the Chrome trace is in the run's profile/ folder), peak memory
allocated and reserved, each beside the planner's figure, the attention and Adam it used, and how
many console lines came before its first step line (under 40: one screen); and
the planner's step time and memory for the run's own config twice, printed beside the measurement:
on the datasheet cluster it ran with (GPU: the conf/cluster file of its model, 1xh200 on an H200)
and on the probed one (OUT/probe's cluster file, the run's node size).
Results go to OUT/gpu_check.json (rewritten after every step) and every step's output to
OUT/gpu_check.log; OUT is --out, else $OUT, else a new temporary directory. `--only a,b` runs
those steps alone (all of them: 960 s of fixed limits plus the megatron step's budget on a GPU);
`--budget S` skips, in the order above, each step whose limit is more than what is left of S
seconds (a lent GPU's one call: `--budget 540` fits its 600 s with the install).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Sizes: (model and batch overrides, steps, the step to save and resume at, warm-up steps left out,
# the steps profiled: train.profile_step_start/_end, left out of the step time, which the
# profiler's synchronize and its tracing of every launch slow)
GPU = (
    ["model=llama3_1b", "cluster=1xh200", "precision=bf16", "model.seq_length=2048"]
    + ["train.global_batch=8", "train.micro_batch=2"],
    12,
    6,
    4,
    range(9, 11),
)
CPU = (
    ["model=tiny", "model.num_layers=1", "cluster=cpu", "precision=fp32", "model.seq_length=32"]
    + ["train.global_batch=4", "train.micro_batch=2"],
    4,
    2,
    1,
    range(4, 5),
)
COMMON = ["cluster.nodes=1", "cluster.gpus_per_node=1", "parallel=dp", "data=synthetic", "optim.warmup_steps=1"]
STEPS = (
    "environment",
    "probe",
    "megatron",
    "deepspeed_zero1",
    "deepspeed_zero3",
    "kernels",
    "out_of_memory",
    "bench_overhead",
    "fused_adam_build",
)
# The kernels step's run on a GPU: the H200's llama3_1b at sequence 4096, global batch 32 (2.5-2.7 s a
# step there), 10 steps, the first 3 left out of the medians; micro-batch 4 where the reference
# kernels fit (kernels_micro_batch), else the largest that does.
KERNELS_GPU = (["model.seq_length=4096", "train.global_batch=32"], 10, 3)
# train.kernels=auto against reference: equal in fp32 on CPU (both the reference kernels there); on a
# GPU the fused kernels round in another order, within this of a loss near 11.
KERNELS_TOLERANCE = {"cpu": 0.0, "gpu": 2e-2}
PROBED = "probed"  # the probe step's cluster file: OUT/probe/cluster/probed.yaml
# The resumed steps equal the uninterrupted ones: exactly in fp32 on CPU; in bf16 the GPU's
# attention backward may add in another order (FlashAttention's atomics), within this of a loss near 10.
RESUME_TOLERANCE = {"cpu": 0.0, "gpu": 1e-2}
# A training process's start before its first step (imports, the model built): ~20 s for a 1B
# model on one H200 (measured); the megatron step's budget counts two.
START_S = 30


def _environment() -> dict:
    import shutil

    import torch

    from toolkit.train.capabilities import importable

    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "imports": {m: importable(m) for m in ("transformer_engine.pytorch", "apex", "flash_attn", "deepspeed")},
        "deepspeed": __import__("deepspeed").__version__ if importable("deepspeed") else None,
        "nvcc": shutil.which("nvcc"),
    }


def _fused_adam_build() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: FusedAdam is a CUDA kernel"}
    from deepspeed.ops.op_builder import FusedAdamBuilder

    started = time.monotonic()
    FusedAdamBuilder().load()
    return {"build_s": time.monotonic() - started}


WORKERS = {"environment": _environment, "fused_adam_build": _fused_adam_build}


class Check:
    """Runs the steps, each a subprocess under its own timeout, and keeps the JSON up to date."""

    def __init__(self, out: Path, device: str, python: str):
        self.out, self.device, self.python = out, device, python
        self.results: dict = {"device": device, "steps": {}}
        self.log = open(out / "gpu_check.log", "a")

    def save(self) -> None:
        tmp = self.out / ".gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=2, default=str))
        os.replace(tmp, self.out / "gpu_check.json")

    def command(
        self, name: str, argv: list[str], timeout: float, stdout: Path | None = None, console: bool = False, expect=0
    ) -> None:
        """Run one command to exit code `expect` (StepFailed otherwise: "timeout" or "failed" with its
        exit code). Its output goes to the log (its stdout to the file `stdout`, when given; its stderr
        too with `console`: what a terminal would show, copied into the log after)."""
        self.log.write(f"\n===== {name}: {' '.join(argv)}\n")
        self.log.flush()
        started = time.monotonic()
        errors = subprocess.STDOUT if console else self.log
        try:
            with open(stdout, "w") if stdout else contextlib.nullcontext(self.log) as out:
                code = subprocess.run(argv, cwd=ROOT, stdout=out, stderr=errors, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
        if console and stdout:
            self.log.write(stdout.read_text())
        ended = "timed out" if code is None else f"exit {code}"
        self.log.write(f"===== {name}: {ended} after {time.monotonic() - started:.0f} s\n")
        self.log.flush()
        if code != expect:
            raise StepFailed("timeout" if code is None else "failed", {"exit_code": code})

    def step(self, name: str, timeout: float, run) -> None:
        started = time.monotonic()
        print(f"gpu_check: {name} (at most {timeout:.0f} s)", flush=True)
        try:
            figures = run(timeout)
            status = "ok"
        except StepFailed as failure:
            figures, status = failure.figures, failure.status
        except Exception as error:  # a result that is not what was expected: say so, go on
            figures, status = {"error": f"{type(error).__name__}: {error}"}, "error"
        self.results["steps"][name] = {"status": status, "seconds": round(time.monotonic() - started, 1), **figures}
        self.save()
        print(f"gpu_check: {name}: {status} in {time.monotonic() - started:.0f} s", flush=True)

    def skip(self, name: str, reason: str) -> None:
        self.results["steps"][name] = {"status": "skipped", "reason": reason}
        self.save()
        print(f"gpu_check: {name}: skipped: {reason}", flush=True)

    def worker(self, name: str, timeout: float) -> dict:
        result = self.out / f".{name}.json"
        self.command(name, [self.python, __file__, "--worker", name, "--result", str(result)], timeout)
        return json.loads(result.read_text())

    def train(self, name: str, run_dir: Path, overrides: list[str], timeout: float) -> dict:
        """The run's result.json, with how many lines its console showed up to its first step line."""
        argv = [self.python, "-m", "toolkit.cli", "train", *overrides, f"hydra.run.dir={run_dir}"]
        console = self.out / f"{run_dir.name}.console"
        self.command(name, argv, timeout, stdout=console, console=True)
        return json.loads((run_dir / "result.json").read_text()) | {"console_lines": lines_to_step(console)}


class StepFailed(Exception):
    def __init__(self, status: str, figures: dict):
        super().__init__(status)
        self.status, self.figures = status, figures


def lines_to_step(console: Path) -> int | None:
    """The console's lines from the start to the first step line, that one included (issue: one
    screen, under 40 lines)."""
    lines = console.read_text().splitlines()
    return next((number for number, line in enumerate(lines, 1) if line.startswith("step ")), None)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def profiling(profiled: range) -> list[str]:
    return [f"train.profile_step_start={profiled.start}", f"train.profile_step_end={profiled.stop}"]


def figures(run_dir: Path, result: dict, skip: int, profiled: range = range(0)) -> dict:
    """Measured against predicted, medians over the steps after the warm-up but the profiled ones;
    the profiled steps' summary (toolkit.train.step_profiler) where the run wrote one."""
    steps = records(run_dir)
    timed = [r for r in steps[skip:] if r["step"] not in profiled] or steps

    def median(key):
        return statistics.median(r[key] for r in timed)

    step, predicted_step = median("step_time_s"), steps[-1]["predicted_step_time_s"]
    out = {
        "steps": len(steps),
        "timed_steps": len(timed),
        "step_time_s": step,
        "predicted_step_time_s": predicted_step,
        "tokens_per_s": median("tokens_per_s"),
        "predicted_tokens_per_s": median("tokens_per_s") * step / predicted_step,
        "mfu": median("mfu"),
        "predicted_mfu": median("mfu") * step / predicted_step,
        "memory_allocated_gib": max(r["memory_gib"] for r in steps),
        "predicted_tensors_gib": steps[-1]["predicted_memory_gib"],
        "first_loss": steps[0]["loss"],
        "last_loss": steps[-1]["loss"],
        "kernels": result.get("kernels"),
        "console_lines_to_step_1": result.get("console_lines"),
    }
    profile = run_dir / "profile" / "summary.json"
    if profile.is_file():
        out["profile"] = json.loads(profile.read_text())
    if "memory_reserved_gib" in steps[-1]:  # GPUs: the allocator's reservation too
        out["memory_reserved_gib"] = max(r["memory_reserved_gib"] for r in steps)
        out["predicted_reserved_gib"] = steps[-1]["predicted_reserved_gib"]
    return out


def probe(check: Check, timeout: float) -> dict:
    """`parakit probe` into OUT/probe; the constants its cluster file holds."""
    from toolkit.config.store import compose_config

    directory = check.out / "probe"
    check.command(
        "probe", [check.python, "-m", "toolkit.cli", "probe", "-o", str(directory), "--name", PROBED], timeout
    )
    cluster = compose_config([f"cluster={PROBED}"], config_dirs=[directory]).cluster
    fields = ("gpu", "gemm_efficiency", "sm_count", "hbm_bandwidth_gbs", "op_dispatch_s", "transformer_engine")
    fields += ("checkpoint_write_gbs_per_node", "intra_node_bandwidth_gbs", "collective_latency_s")
    return {
        "cluster_file": str(directory / "cluster" / f"{PROBED}.yaml"),
        **{field: getattr(cluster, field) for field in fields},
        "stack": {backend: dataclasses.asdict(costs) for backend, costs in cluster.stack.items()},
    }


def _planned(cfg) -> dict:
    from toolkit.plan.layout import resolve
    from toolkit.plan.memory import GIB, peak_memory
    from toolkit.plan.perf import estimate_step

    layout = resolve(cfg)
    memory = peak_memory(cfg, layout)
    return {
        "cluster": cfg.cluster.name,
        "step_time_s": estimate_step(cfg, layout).step_time,
        "tensors_gib": memory.tensors / GIB,
        "reserved_gib": memory.reserved / GIB,
    }


def predictions(check: Check, run_dir: Path) -> dict:
    """The planner on the run's own config (its config.yaml): on the cluster it ran with (the
    datasheet's) and on the probed cluster with the run's node size (None where no probe wrote one)."""
    from toolkit.config.store import compose_config, load_run_config

    cfg = load_run_config(run_dir)
    out = {"datasheet": _planned(cfg), "probed": None}
    if (check.out / "probe" / "cluster" / f"{PROBED}.yaml").is_file():
        probed = compose_config([f"cluster={PROBED}"], config_dirs=[check.out / "probe"]).cluster
        probed = dataclasses.replace(probed, nodes=cfg.cluster.nodes, gpus_per_node=cfg.cluster.gpus_per_node)
        out["probed"] = _planned(dataclasses.replace(cfg, cluster=probed))
    return out


def _error(predicted: float, measured: float) -> str:
    return f"{predicted / measured - 1:+.0%}" if measured else "n/a"


def comparison(name: str, measured: dict) -> list[str]:
    """Lines: the measured step time and memory, the datasheet's and the probed prediction beside."""
    step, allocated, reserved = (
        measured["step_time_s"],
        measured["memory_allocated_gib"],
        measured.get("memory_reserved_gib"),
    )
    lines = [f"{name}: step {step:.3f} s measured", f"{name}: memory {allocated:.2f} GiB allocated"]
    if reserved is not None:
        lines[1] += f", {reserved:.2f} reserved"
    lines[1] += " measured"
    for kind in ("datasheet", "probed"):
        planned = measured.get(kind)
        if planned is None:
            lines[0] += f"; {kind}: none (no probed cluster)"
            continue
        seconds = planned["step_time_s"]
        lines[0] += f"; {kind} (cluster={planned['cluster']}) {seconds:.3f} s {_error(seconds, step)}"
        lines[1] += f"; {kind} {planned['tensors_gib']:.2f} {_error(planned['tensors_gib'], allocated)}"
        if reserved is not None:
            lines[1] += f", {planned['reserved_gib']:.2f} {_error(planned['reserved_gib'], reserved)}"
    return lines


def compared(check: Check, name: str, run_dir: Path, measured: dict) -> dict:
    """`measured` with the two predictions, printed beside it (a prediction that fails to compute
    is recorded as such: the measurement stands)."""
    try:
        measured |= predictions(check, run_dir)
    except Exception as error:
        measured["predictions_error"] = f"{type(error).__name__}: {error}"
        print(f"gpu_check: {name}: no predictions: {measured['predictions_error']}", flush=True)
        return measured
    for line in comparison(name, measured):
        print(f"gpu_check: {line}", flush=True)
    if "profile" in measured:
        from toolkit.train.step_profiler import describe

        for line in describe(measured["profile"]).splitlines():
            print(f"gpu_check: {name}: profiled {line}", flush=True)
    return measured


def _megatron_overrides(size) -> list[str]:
    overrides, steps, *_ = size
    return [*overrides, *COMMON, "backend=megatron", "zero=1", f"train.steps={steps}", "checkpoint.verify=size"]


def megatron_budget(check: Check, size) -> dict:
    """The megatron step's time limit, from the planner: two processes started (START_S each: import,
    build, first step's set-up), every step at the predicted step time, and three checkpoint
    transfers (the saves at step `at` and at the end, the resumed run's load) at the predicted save
    time on the probed filesystem's write speed (the cluster file's where no probe ran), all
    twice over for the disk's and the machine's variation."""
    from toolkit.config.store import compose_config
    from toolkit.plan.checkpoint import checkpoint_bytes, estimated_save_seconds
    from toolkit.plan.layout import resolve
    from toolkit.plan.perf import estimate_step

    _, steps, at, *_ = size
    cfg = compose_config(_megatron_overrides(size))
    if (check.out / "probe" / "cluster" / f"{PROBED}.yaml").is_file():
        probed = compose_config([f"cluster={PROBED}"], config_dirs=[check.out / "probe"]).cluster
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(probed, nodes=1, gpus_per_node=1))
    layout = resolve(cfg)
    step_s, save_s = estimate_step(cfg, layout).step_time, estimated_save_seconds(cfg, layout)
    seconds = 2 * (2 * START_S + (2 * steps - at) * step_s + 3 * save_s)
    return {
        "budget_s": seconds,
        "predicted_step_time_s": step_s,
        "predicted_save_s": save_s,
        "checkpoint_gb": checkpoint_bytes(cfg, layout) / 1e9,
        "write_gbs": cfg.cluster.checkpoint_write_gbs_per_node,
        "cluster": cfg.cluster.name,
    }


def _save_figures(checkpoint: Path) -> dict:
    """What one save cost (its manifest): size, seconds training waited, throughput, host memory."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    size = sum(entry["bytes"] for entry in manifest["files"].values())
    seconds = manifest["write_seconds"] + manifest["checksum_seconds"]
    return {
        "save_gb": size / 1e9,
        "save_s": seconds,
        "save_gbs": size / 1e9 / seconds,
        "save_peak_extra_gb": max(manifest["write_peak_extra_bytes"]) / 1e9,
    }


def megatron_resume(check: Check, size, timeout: float) -> dict:
    """The run, saved at step 6 (and at its end); then a second process resumes from step 6's
    checkpoint alone: its steps 7-12 must be the first run's. The save's and the load's figures
    go beside the planner's budget (`megatron_budget`)."""
    import shutil

    _, steps, at, skip, profiled = size
    base = _megatron_overrides(size)
    deadline = time.monotonic() + timeout
    whole = check.out / "megatron_whole"
    argv = [*base, f"checkpoint.interval_steps={at}", *profiling(profiled)]
    result = check.train("megatron", whole, argv, timeout)
    measured = compared(check, "megatron", whole, figures(whole, result, skip, profiled))
    measured |= _save_figures(whole / "checkpoints" / f"step_{at:08d}")
    shutil.rmtree(whole / "checkpoints" / f"step_{steps:08d}")  # the newest left is step `at`'s
    resumed = check.out / "megatron_resumed"
    left = deadline - time.monotonic()
    if left <= 0:
        raise StepFailed("timeout", measured)
    again = check.train("megatron resumed", resumed, [*base, f"checkpoint.dir={whole / 'checkpoints'}"], left)
    measured["load_s"] = again.get("resume_load_seconds")
    reference = {r["step"]: r["loss"] for r in records(whole)}
    again = {r["step"]: r["loss"] for r in records(resumed)}
    if sorted(again) != list(range(at + 1, steps + 1)):
        raise StepFailed("failed", {**measured, "resumed_steps": sorted(again)})
    difference = max(abs(again[s] - reference[s]) for s in again)
    tolerance = RESUME_TOLERANCE[check.device]
    measured |= {"resumed_at_step": at, "resume_max_loss_difference": difference, "resume_tolerance": tolerance}
    if difference > tolerance:
        raise StepFailed("failed", measured)
    return measured


def deepspeed_run(check: Check, size, zero: int, timeout: float) -> dict:
    overrides, steps, _, skip, profiled = size
    run_dir = check.out / f"deepspeed_zero{zero}"
    argv = [*overrides, *COMMON, "backend=deepspeed", f"zero={zero}", f"train.steps={steps}", *profiling(profiled)]
    measured = figures(run_dir, check.train(f"deepspeed zero{zero}", run_dir, argv, timeout), skip, profiled)
    return compared(check, f"deepspeed_zero{zero}", run_dir, measured)


def kernels_runs(check: Check, size, timeout: float) -> dict:
    """Each backend with train.kernels=reference and =auto (the fused kernels on a GPU: Liger's on the
    deepspeed backend, megatron-core's fusions and fused cross-entropy on megatron): step time, MFU and
    memory of each, and how far apart their losses are at every step (from the same seed)."""
    overrides, steps, _, skip, _ = size
    measured: dict = {}
    if check.device == "gpu":
        extra, steps, skip = KERNELS_GPU
        overrides = [*overrides, *extra]
        micro = kernels_micro_batch(overrides)
        overrides.append(f"train.micro_batch={micro}")
        measured["micro_batch"] = micro
    for backend in ("megatron", "deepspeed"):
        losses = []
        for kernels in ("reference", "auto"):
            name = f"{backend}_{kernels}"
            run_dir = check.out / f"kernels_{name}"
            argv = [
                *overrides,
                *COMMON,
                f"backend={backend}",
                "zero=1",
                f"train.steps={steps}",
                f"train.kernels={kernels}",
            ]
            measured[name] = figures(run_dir, check.train(f"kernels {name}", run_dir, argv, timeout / 4), skip)
            losses.append([r["loss"] for r in records(run_dir)])
        measured[f"{backend}_max_loss_difference"] = max(abs(a - b) for a, b in zip(*losses))
    measured["tolerance"] = tolerance = KERNELS_TOLERANCE[check.device]
    if any(measured[f"{b}_max_loss_difference"] > tolerance for b in ("megatron", "deepspeed")):
        raise StepFailed("failed", measured)
    return measured


# The out-of-memory step's run on a GPU: llama3_1b's micro-batch of 64 sequences of 2048 (its logits
# alone 67 GB in fp32) past any card, the validator's memory check off so that it starts.
OOM_GPU = ["train.micro_batch=64", "train.global_batch=64", "checks.memory=off"]
# On CPU no allocator runs out: the drill raises at step 1 as the CUDA allocator raises.
OOM_CPU = ["train.fault.oom_rank=0", "train.fault.oom_at_step=1"]


def out_of_memory(check: Check, size, timeout: float) -> dict:
    """A run that does not fit: exit 1 with the report (what ran out, what the allocator held, the
    planner's terms, the fix) and, on a GPU, the allocator's snapshot in RUN_DIR/oom/."""
    overrides, _, _, _, _ = size
    run_dir = check.out / "out_of_memory"
    console = check.out / "out_of_memory.console"
    extra = OOM_GPU if check.device == "gpu" else OOM_CPU
    argv = [*overrides, *COMMON, "backend=megatron", "train.steps=2", *extra, f"hydra.run.dir={run_dir}"]
    check.command("out_of_memory", [check.python, "-m", "toolkit.cli", "train", *argv], timeout, console, True, 1)
    said = console.read_text()
    snapshot = run_dir / "oom" / "rank0.pickle"
    measured = {
        "report": [line.strip() for line in said.splitlines() if "ran out of memory" in line or "Fix:" in line],
        "snapshot_bytes": snapshot.stat().st_size if snapshot.is_file() else None,
        "console_lines": len(said.splitlines()),
    }
    if not measured["report"] or (check.device == "gpu" and not measured["snapshot_bytes"]):
        raise StepFailed("failed", measured)
    return measured


def kernels_micro_batch(overrides: list[str]) -> int:
    """The largest micro-batch of 4, 2, 1 at which both backends with the reference kernels pass the
    validator's memory check on this cluster (the DeepSpeed run that reserved 91 GiB on an H200 at
    micro-batch 4 does not fit an 80 GB H100)."""
    from toolkit.config.store import compose_config
    from toolkit.plan.validate import validate

    for micro in (4, 2):
        configs = (
            compose_config(
                [*overrides, *COMMON, f"backend={b}", "zero=1", "train.kernels=reference", f"train.micro_batch={micro}"]
            )
            for b in ("megatron", "deepspeed")
        )
        if all(validate(c, data=False).ok for c in configs):
            return micro
    return 1


def kernels_summary(step: dict) -> list[str]:
    """Each backend's reference and fused runs side by side."""
    lines = []
    for backend in ("megatron", "deepspeed"):
        runs = [(k, step.get(f"{backend}_{k}")) for k in ("reference", "auto")]
        if not all(run for _, run in runs):
            continue
        cells = [
            f"{kernels} {run['step_time_s']:.3f} s, MFU {run['mfu']:.1%}, {run['memory_allocated_gib']:.1f} GiB"
            + (f" ({run['memory_reserved_gib']:.1f} reserved)" if "memory_reserved_gib" in run else "")
            for kernels, run in runs
        ]
        difference = step[f"{backend}_max_loss_difference"]
        lines.append(f"kernels {backend}: {'; '.join(cells)}; losses at most {difference:.2e} apart")
    return lines


def bench_overhead(check: Check, timeout: float) -> dict:
    """scripts/bench_overhead.py, shortened: one parakit and one bare megatron-core process."""
    result = check.out / ".bench_overhead.json"
    if check.device == "gpu":
        short = ["--gpu", "--steps", "6", "--warmup", "2"]
    else:  # the toy model of the CPU size
        short = ["--steps", "1", "--warmup", "1", "--", "model.num_layers=1", "model.seq_length=32"]
    argv = [check.python, "scripts/bench_overhead.py", "--json", "--repeats", "1", "--backend", "megatron", *short]
    check.command("bench_overhead", argv, timeout, stdout=result)
    return json.loads(result.read_text())["megatron"]


def datasheet_size(device_name: str):
    """The GPU size on the conf/cluster file of this GPU's model (1xh200 where none matches)."""
    from toolkit.config.store import datasheet_cluster

    cluster = f"cluster={datasheet_cluster(device_name) or '1xh200'}"
    overrides, *rest = GPU
    return ([cluster if o.startswith("cluster=") else o for o in overrides], *rest)


def summary(steps: dict) -> list[str]:
    """A table of the training runs: measured step time and memory, each prediction beside."""
    rows = [(name, step) for name, step in steps.items() if "step_time_s" in step]
    if not rows:
        return []
    lines = [
        "predicted beside measured (error: predicted / measured - 1)",
        f"{'run':<17}{'step s':>8}{'datasheet':>17}{'probed':>17}{'alloc GiB':>11}{'datasheet':>17}{'probed':>17}",
    ]
    for name, step in rows:
        line = f"{name:<17}{step['step_time_s']:>8.3f}"
        cells = []
        for key, measured in (("step_time_s", step["step_time_s"]), ("tensors_gib", step["memory_allocated_gib"])):
            for kind in ("datasheet", "probed"):
                planned = step.get(kind)
                cells.append(f"{planned[key]:>9.3f} ({_error(planned[key], measured):>5})" if planned else f"{'-':>17}")
        line += "".join(cells[:2]) + f"{step['memory_allocated_gib']:>11.2f}" + "".join(cells[2:])
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the same steps at toy size on CPU (a dry run)")
    parser.add_argument("--out", type=Path, help="where gpu_check.json and gpu_check.log go (default $OUT)")
    parser.add_argument("--python", default=sys.executable, help="the Python every step runs in (default: this one)")
    parser.add_argument("--only", help=f"comma-separated steps to run, of {','.join(STEPS)} (default: all)")
    parser.add_argument(
        "--budget",
        type=float,
        help="wall seconds for the whole check (a lent GPU's time): a step whose time limit is more than "
        "what is left is skipped, and the next ones that fit still run",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.budget is not None and args.budget <= 0:
        parser.error(f"--budget: {args.budget:g} s; give the seconds the check may take, more than 0")
    if args.worker:
        args.result.write_text(json.dumps(WORKERS[args.worker]()))
        return 0
    only = args.only.split(",") if args.only else list(STEPS)
    if set(only) - set(STEPS):
        parser.error(f"--only: no step {', '.join(sorted(set(only) - set(STEPS)))}; the steps: {', '.join(STEPS)}")
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here (torch.cuda.is_available() is False); --cpu runs the dry run",
            file=sys.stderr,
        )
        return 2
    out = args.out or Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="parakit-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, "cpu" if args.cpu else "gpu", args.python)
    size = CPU if args.cpu else datasheet_size(torch.cuda.get_device_name(0))
    # Timeouts, seconds (a 1B model: ~20 s to import and build; DeepSpeed initialises it on the host
    # first; the GPU probe about a minute, the CPU one cached, else measured once: about two). The
    # megatron step's follows its predicted save and step times (megatron_budget).
    steps = {
        "environment": (40, lambda t: check.worker("environment", t)),
        "probe": (300 if args.cpu else 120, lambda t: probe(check, t)),
        "megatron": (None, lambda t: megatron_resume(check, size, t)),  # megatron_budget, after the probe
        **{f"deepspeed_zero{zero}": (90, lambda t, zero=zero: deepspeed_run(check, size, zero, t)) for zero in (1, 3)},
        # four runs: on a GPU each ~30 s to start, 10 steps of ~2.6 s, and the first step's compiles
        # (torch.compile's fused cross-entropy, Liger's Triton kernels)
        "kernels": (360, lambda t: kernels_runs(check, size, t)),
        "out_of_memory": (120, lambda t: out_of_memory(check, size, t)),
        "bench_overhead": (80, lambda t: bench_overhead(check, t)),
        "fused_adam_build": (60, lambda t: check.worker("fused_adam_build", t)),
    }
    began = time.monotonic()
    for name in STEPS:
        if name not in only:
            continue
        timeout, run = steps[name]
        if timeout is None:
            budget = megatron_budget(check, size)
            check.results["megatron_budget"] = budget
            timeout = budget["budget_s"]
            print(
                f"gpu_check: megatron budget {timeout:.0f} s: a {budget['checkpoint_gb']:.1f} GB checkpoint at "
                f"{budget['write_gbs']:.2f} GB/s ({budget['predicted_save_s']:.0f} s per save, cluster="
                f"{budget['cluster']}), steps of {budget['predicted_step_time_s']:.2f} s, twice over",
                flush=True,
            )
        left = None if args.budget is None else args.budget - (time.monotonic() - began)
        if left is not None and timeout > left:
            check.skip(name, f"its limit ({timeout:.0f} s) is more than the {left:.0f} s left of --budget")
            continue
        check.step(name, timeout, run)
    for line in summary(check.results["steps"]) + kernels_summary(check.results["steps"].get("kernels", {})):
        print(f"gpu_check: {line}")
    statuses = {name: step["status"] for name, step in check.results["steps"].items()}
    failed = [name for name, status in statuses.items() if status not in ("ok", "skipped")]
    skipped = [name for name, status in statuses.items() if status == "skipped"]
    print(
        f"gpu_check: results in {out / 'gpu_check.json'}"
        + (f"; not ok: {', '.join(failed)}" if failed else "")
        + (f"; skipped for --budget: {', '.join(skipped)}" if skipped else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
