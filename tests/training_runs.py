"""Helpers of the multi-process training tests: run `parakit train` in a subprocess, read what the
run left behind (metrics, result.json, the final parameters gathered to full tensors from its
checkpoint), and compare two runs."""

import copy
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from warm.server import WARM_ENV, ranks_dir

from toolkit.config.store import compose_config
from toolkit.plan.checkpoint import checkpoint_plan
from toolkit.plan.layout import resolve

MUTANTS = Path(__file__).parent / "mutants"
# The DeepSpeed tests' short fp32 run (tests/test_train_deepspeed.py, tests/test_faults_deepspeed.py)
DEEPSPEED_SHORT = [
    "model=tiny",
    "backend=deepspeed",
    "data=synthetic",
    "precision=fp32",
    "train.steps=4",
    "train.global_batch=8",
    "train.micro_batch=2",
    "optim.lr=1e-3",
    "optim.warmup_steps=0",
]


def python() -> str:
    """The Python to start a module or script with: the suite's warm one (tests/warm) where it
    runs, so the process does not import torch, megatron-core and DeepSpeed again, and the Python
    processes it starts go warm too. Tests whose subject is a fresh interpreter use sys.executable."""
    return os.environ.get("PYTHON_EXEC", sys.executable)


def parakit(*args: str) -> list[str]:
    """The command line of `parakit ARGS` in a subprocess, through python()."""
    return [python(), "-u", "-m", "toolkit.cli", *args]


def processes_naming(text: str) -> list[str]:
    """Processes whose command line names `text`, and warm ranks (tests/warm) running such a
    command (their command line is the server's: the server records theirs)."""
    found = subprocess.run(["pgrep", "-f", text], capture_output=True, text=True).stdout.split()
    socket = os.environ.get(WARM_ENV[1])
    directory = Path(ranks_dir(socket)) if socket else None
    for record in directory.iterdir() if directory and directory.is_dir() else ():
        try:
            alive = Path("/proc", record.name).exists() and text in record.read_text()
        except FileNotFoundError:  # it ended meanwhile
            continue
        if alive:
            found.append(f"{record.name} (warm)")
    return found


def run(tmp_path, name, *overrides, timeout=600, mutation=None, command="train"):
    """`parakit train OVERRIDES` (or another `command`) in tmp_path/name; the result carries
    .seconds and .run_dir. `mutation` injects one of the test-only defects of
    tests/mutants/sitecustomize.py."""
    run_dir = tmp_path / name
    started = time.monotonic()
    env = {**os.environ, "PARAKIT_DIST_TIMEOUT_S": "180"}
    if mutation:
        env.update(
            PARAKIT_MUTATION=mutation, PYTHONPATH=os.pathsep.join(filter(None, [str(MUTANTS), env.get("PYTHONPATH")]))
        )
    result = subprocess.run(
        parakit(command, *overrides, f"hydra.run.dir={run_dir}"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    result.seconds = time.monotonic() - started
    result.run_dir = run_dir
    return result


def train(tmp_path, name, *overrides, timeout=900) -> list[float]:
    """A run that must complete: its loss curve."""
    result = run(tmp_path, name, *overrides, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return losses(result)


def trained(tmp_path, name, *overrides, timeout=900, mutation=None) -> "Trained":
    """A run that must complete, for comparisons: its records and final parameters."""
    result = run(tmp_path, name, *overrides, timeout=timeout, mutation=mutation)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return Trained(result.run_dir)


def losses(result) -> list[float]:
    assert (result.run_dir / "result.json").exists(), result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads((result.run_dir / "result.json").read_text())["losses"]


def jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def records(result) -> list[dict]:
    """The step records of metrics.jsonl (evaluations have records of their own)."""
    return [r for r in jsonl(result.run_dir) if "loss" in r]


def saved_steps(result) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (result.run_dir / "checkpoints").glob("step_*"))


def check_planned_interval(result, *overrides) -> None:
    """The run printed the planner's interval for its measured save and step times, and saved at
    step 1 (the measurement), every N steps after, and at the end."""
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.search(r"checkpoint interval: every (\d+) steps .*save ([\d.]+) s, step ([\d.]+) s", result.stdout)
    assert found, result.stdout[-2000:]
    every, save_seconds, step_seconds = int(found[1]), float(found[2]), float(found[3])
    cfg = compose_config([*overrides, f"checkpoint.save_seconds={save_seconds}"])
    printed_to = 0.0005  # the figures are printed to 3 decimals
    assert every in {
        checkpoint_plan(cfg, resolve(cfg), step_seconds + e).recommended_steps for e in (-printed_to, 0, printed_to)
    }
    steps = cfg.train.steps
    assert saved_steps(result) == sorted({1, steps, *range(every, steps + 1, every)})


# The planner's interval rule on a short run: a rework bound of 3 s gives, with ~1 s steps, a save
# every few steps.
AUTO_INTERVAL = [
    "checkpoint.interval_steps=null",
    "checkpoint.auto_interval=true",
    "checkpoint.keep_last=10",
    "train.steps=8",
    "checkpoint.acceptable_rework_minutes=0.025",
]


class Trained:
    """What a finished run left behind: its step records, result.json and final parameters."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.records = [r for r in jsonl(run_dir) if "loss" in r]
        self.evaluations = [r for r in jsonl(run_dir) if "val_loss" in r]
        self.result = json.loads((run_dir / "result.json").read_text())

    @property
    def checkpoints(self) -> Path:
        import yaml

        configured = yaml.safe_load((self.run_dir / "config.yaml").read_text())["checkpoint"]["dir"]
        return Path(configured) if configured else self.run_dir / "checkpoints"

    @cached_property
    def parameters(self) -> dict:
        return checkpoint_parameters(self.checkpoints / (self.checkpoints / "latest").read_text().strip())

    def through(self, step: int) -> "Trained":
        """The same run, its records up to `step` only (to compare with a run stopped there)."""
        earlier = copy.copy(self)
        earlier.records = [r for r in self.records if r["step"] <= step]
        earlier.evaluations = [r for r in self.evaluations if r["step"] <= step]
        return earlier

    def after(self, step: int) -> "Trained":
        """The same run, its records after `step` only (to compare with a run resumed there)."""
        later = copy.copy(self)
        later.records = [r for r in self.records if r["step"] > step]
        later.evaluations = [r for r in self.evaluations if r["step"] > step]
        return later


def checkpoint_parameters(directory: Path) -> dict:
    """The model's parameters in a published checkpoint of either backend, gathered into full
    tensors by the libraries' own readers: torch.distributed.checkpoint for megatron-core's
    dist checkpoints (layout-free keys, layers stacked), DeepSpeed's zero_to_fp32 for ZeRO 1-3,
    the module states for ZeRO-0 and the pipeline's per-layer files (renamed to transformers')."""
    if (directory / "model_optim").exists():
        return dist_checkpoint_parameters(directory / "model_optim")
    state = directory / "state"
    layers = sorted(state.glob("layer_*-model_states.pt"))
    if layers:
        return _pipeline_parameters(layers)
    if list(state.glob("zero_pp_rank_*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(directory), tag="state"))
    return torch.load(state / "mp_rank_00_model_states.pt", weights_only=False)["module"]


def dist_checkpoint_parameters(directory: Path) -> dict:
    """Model tensors of a megatron-core dist checkpoint (optimizer states and extra states left out)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(directory), f"{tmp}/full.pt")
        full = torch.load(f"{tmp}/full.pt", weights_only=False)
    # optimizer states: "optimizer.*", or "chained_N.optimizer.*" where expert parallel gives the
    # experts an optimizer of their own (megatron-core's ChainedOptimizer)
    return {k: v for k, v in full.items() if isinstance(v, torch.Tensor) and "optimizer." not in k}


def _pipeline_parameters(layer_files: list) -> dict:
    """DeepSpeed pipeline layers (toolkit.train.deepspeed_pipe, Llama-style) -> transformers names."""
    last = len(layer_files) - 1
    names = {
        0: {"tokens.weight": "model.embed_tokens.weight"},
        last: {"norm.weight": "model.norm.weight", "head.weight": "lm_head.weight"},
    }
    out = {}
    for index, path in enumerate(layer_files):
        for key, tensor in torch.load(path, weights_only=False).items():
            out[names[index][key] if index in names else f"model.layers.{index - 1}.{key.removeprefix('layer.')}"] = (
                tensor
            )
    return out


def unmoved_parameters(before: dict, after: dict) -> list[str]:
    """Parameters (each layer of megatron-core's stacked layer tensors on its own) that did not change."""
    unmoved = []
    for name, tensor in after.items():
        slices = (
            enumerate(zip(before[name], tensor))
            if name.startswith("decoder.layers.")
            else [(None, (before[name], tensor))]
        )
        unmoved += [f"{name}[{i}]" if i is not None else name for i, (a, b) in slices if torch.equal(a, b)]
    return unmoved


@dataclass(frozen=True)
class Tolerance:
    """How close two runs of one training must be (each test states why)."""

    loss: float  # absolute, at every step
    grad_norm: float  # relative, at every step
    parameters: float  # root mean square of the difference, per final parameter tensor


def assert_same_training(reference: Trained, got: Trained, tolerance: Tolerance, grad_norm: bool = True) -> None:
    """The same steps (assert_same_steps), and every final parameter within tolerance. Max-abs is
    no measure for the parameters: Adam divides by sqrt(v) + eps, so the few elements whose
    gradient is near eps turn rounding differences of 1e-12 into 1e-5 (measured: 20 of 3.2M
    embedding elements), while the rest agree to 1e-8."""
    assert_same_steps(reference, got, tolerance, grad_norm)
    assert_same_parameters(reference.parameters, got.parameters, tolerance.parameters)


def assert_same_steps(reference: Trained, got: Trained, tolerance: Tolerance, grad_norm: bool = True) -> None:
    """The same steps with the same learning rate (exactly), every step's loss and gradient norm
    within tolerance. `grad_norm=False` for a run whose engine reports none (DeepSpeed ZeRO-0)."""
    assert [r["step"] for r in got.records] == [r["step"] for r in reference.records]
    for ref, rec in zip(reference.records, got.records):
        assert math.isclose(rec["loss"], ref["loss"], rel_tol=0, abs_tol=tolerance.loss), (
            rec["step"],
            "loss",
            rec["loss"],
            ref["loss"],
        )
        assert rec["lr"] == ref["lr"], (rec["step"], "lr", rec["lr"], ref["lr"])
        if grad_norm:
            assert ref["grad_norm"] is not None and rec["grad_norm"] is not None, (rec["step"], "no grad norm")
            assert math.isclose(rec["grad_norm"], ref["grad_norm"], rel_tol=tolerance.grad_norm), (
                rec["step"],
                "grad norm",
                rec["grad_norm"],
                ref["grad_norm"],
            )


def parameter_differences(reference: dict, got: dict) -> dict:
    """Root mean square of the difference, per tensor."""
    assert sorted(got) == sorted(reference)
    return {
        name: (got[name].float() - tensor.float()).pow(2).mean().sqrt().item() for name, tensor in reference.items()
    }


def assert_same_parameters(reference: dict, got: dict, tolerance: float) -> None:
    off = {name: rms for name, rms in parameter_differences(reference, got).items() if not rms <= tolerance}
    assert not off, f"final parameters differ (RMS) by more than {tolerance}: {off}"


def assert_stage_times(run: Trained, pp: int) -> None:
    """Every rank recorded its compute seconds per step (toolkit.train.probe) and result.json the
    time per pipeline stage: each positive, and no rank's median computing longer than a step takes
    (counting evaluation or a pass twice would double it; per step a rank's own step window is
    not rank 0's, measured up to 1.3x apart). Mutation, by hand: every pass counted twice put the
    median at 1.7x the step in pp2 and 1.30x in tp2 pp2 vpp2 (whose ranks wait longest), both caught."""
    ranks, stages = run.result["ranks"], run.result["stage_times_s"]
    assert len(stages) == pp and all(t > 0 for t in stages), stages
    assert sorted(r["stage"] for r in ranks) == sorted(s for s in range(pp) for _ in range(len(ranks) // pp))
    step_times = [r["step_time_s"] for r in run.records]
    for r in ranks:
        assert len(r["compute_s"]) == len(step_times)
        assert all(c > 0 for c in r["compute_s"]), r
        assert statistics.median(r["compute_s"]) <= 1.25 * statistics.median(step_times), (r, step_times)
