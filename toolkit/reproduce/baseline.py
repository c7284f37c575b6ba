"""Baselines: what a recipe is expected to give, stored beside the recipes as
CONFIG_DIR/baselines/NAME.yaml (the package's toolkit/conf/baselines for the shipped recipes).

A measured baseline carries the golden loss curve (the loss at every step, with the tolerance that
applies to it), throughput and peak memory per hardware class, and its provenance (command, code
version, date, machine, library versions). A GPU recipe's baseline carries its published source's
figures instead (the paper or model table it reproduces, with the citation and the quoted row).
"""

from __future__ import annotations

import getpass
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml

BASELINES = "baselines"  # the folder beside recipe/ in a config directory

# Loss tolerances per step (max |measured - golden|). fp32 on CPU repeats bit for bit on one
# machine (measured: deviation 0 at all 12 demo steps, in the test suite under load); another
# CPU's kernels add partial sums in another order (not measured here: one float32 ulp, 1e-6 at a
# loss of 10, per step, that training amplifies). 1e-4 leaves room for that and still catches what
# tests/test_reproduce.py breaks on purpose within three steps (a 10% higher learning rate,
# another seed, a layer dropped). bf16 runs on GPUs differ from run to run by nondeterministic
# reductions (~1e-2 after a few hundred steps in Megatron-LM's functional tests): a band of 0.05.
# The learning rate per step is arithmetic in Python floats (toolkit/plan/lr_schedule.py), the same on
# every machine: relative 1e-9 is rounding; the smallest defect it must catch, a learning rate 1%
# off (inside the loss band over a short run: the first update moves the loss by ~1e-3), is 1e-2.
LR_TOLERANCE = 1e-9
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 0.05, "fp16": 0.05, "fp8": 0.08}
# On the hardware class the curve was recorded on, fp32 on CPU repeats bit for bit (measured here:
# the demo, the MoE and ZeRO-3 recipes run again over their 40 steps, deviation 0.0), so any change
# of numerics fails there, from the first step it moves (float64 gradient norms moved the demo and
# the MoE at step 6 by 1e-6). Another CPU sums in another order: Intel Xeon -> AMD EPYC at the same
# code moved the demo by at most 4.8e-7 over 40 steps and the MoE, whose routing amplifies it, by
# 1e-6 at step 8 and 2e-4 at step 29: there the baseline's band applies (the MoE's: 5e-4).
SAME_CLASS_LOSS_TOLERANCE = {("cpu", "fp32"): 0.0}
MIN_CORRELATION = 0.99  # of the measured and golden curves (Pearson), as golden-value checks use
# Throughput on a shared CPU varies by tens of percent with the load; a GPU node by a few.
THROUGHPUT_TOLERANCE = {"cpu": 0.35, "cuda": 0.05}
# Tensor bytes repeat closely for the same configuration, but when Python's garbage collector frees
# cycles moves the peak: the demo measured +8.1% on a loaded machine with checkpoint saves. The MoE
# spreads wider (five runs on one machine: 0.0755 to 0.0911 GiB): its baseline carries 0.2.
MEMORY_TOLERANCE = 0.15


@dataclass
class Measured:
    """Throughput and memory on one hardware class."""

    tokens_per_s: float
    tokens_per_s_tolerance: float  # relative: slower than (1 - this) x baseline fails
    memory_gib: float | None  # the most bytes tensors held on any rank
    memory_tolerance: float = MEMORY_TOLERANCE


@dataclass
class Published:
    """A GPU recipe's published figures: what the run it reproduces measured."""

    source: str
    quote: str
    figures: dict  # tflops_per_gpu, mfu, tokens_per_s_per_gpu, ... as the source gives them
    conditions: str = ""  # how the published run differs from the recipe, if it does
    published_run: str | None = None  # the id in scripts/data/published_runs.yaml, when there is one


@dataclass
class Baseline:
    recipe: str
    overrides: list[str] = field(default_factory=list)  # what the recorded run was given besides the recipe
    loss: dict[int, float] = field(default_factory=dict)  # step -> loss: the golden curve
    loss_tolerance: float | None = None
    loss_hardware: str | None = None  # the hardware class the curve was recorded on (None: not kept)
    # step -> learning rate: the schedule the curve was trained with (none in a baseline recorded
    # before parakit kept it: not compared)
    lr: dict[int, float] = field(default_factory=dict)
    min_correlation: float = MIN_CORRELATION
    hardware: dict[str, Measured] = field(default_factory=dict)  # hardware class -> figures
    published: Published | None = None
    provenance: dict = field(default_factory=dict)

    def to_yaml(self) -> str:
        document = asdict(self)
        document["loss"] = {int(k): float(v) for k, v in sorted(self.loss.items())}
        document["lr"] = {int(k): float(v) for k, v in sorted(self.lr.items())}
        if self.published is None:
            document.pop("published")
        return yaml.safe_dump(document, sort_keys=False, width=110)

    @classmethod
    def from_yaml(cls, text: str, where: str) -> Baseline:
        document = yaml.safe_load(text) or {}
        if not isinstance(document, dict) or "recipe" not in document:
            raise BaselineError(f"{where}: not a baseline (no `recipe:`)")
        try:
            hardware = {k: Measured(**v) for k, v in (document.pop("hardware", None) or {}).items()}
            published = document.pop("published", None)
            loss = {int(k): float(v) for k, v in (document.pop("loss", None) or {}).items()}
            lr = {int(k): float(v) for k, v in (document.pop("lr", None) or {}).items()}
            return cls(**document, loss=loss, lr=lr, hardware=hardware, published=published and Published(**published))
        except (TypeError, ValueError) as e:
            raise BaselineError(f"{where}: {e}") from None


class BaselineError(ValueError):
    """A baseline file that does not read; the message names the file."""


def baseline_path(recipe: str, dirs: list[Path]) -> Path | None:
    """The recipe's baseline: CONFIG_DIR/baselines/NAME.yaml in the first directory of the search
    path that has one; None where none does."""
    for d in dirs:
        path = d / BASELINES / f"{recipe}.yaml"
        if path.is_file():
            return path
    return None


def record_path(recipe: str, dirs: list[Path]) -> Path:
    """Where `--record` writes: beside the recipe (the search-path directory whose recipe/ has it)."""
    home = next((d for d in dirs if (d / "recipe" / f"{recipe}.yaml").is_file()), dirs[0])
    return home / BASELINES / f"{recipe}.yaml"


def load(path: Path) -> Baseline:
    return Baseline.from_yaml(path.read_text(), str(path))


def hardware_class(device: str) -> str:
    """What throughput compares across: the GPU model and count, or the CPU model and core count
    (CPU ranks time-share the cores)."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {model}, {len(os.sched_getaffinity(0))} cores"


def _code_version() -> str:
    here = Path(__file__).resolve().parents[2]
    try:
        described = subprocess.run(
            ["git", "-C", str(here), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
        )
        if described.returncode == 0:
            return described.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"parakit {version('parakit')}"
    except PackageNotFoundError:
        return "unknown"


def provenance(command: list[str], device: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    libraries = {}
    for name in ("torch", "megatron-core", "deepspeed", "transformers", "hydra-core"):
        try:
            libraries[name] = version(name)
        except PackageNotFoundError:
            libraries[name] = None
    return {
        "command": " ".join(command),
        "code_version": _code_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} ({hardware_class(device)}), by {getpass.getuser()}",
        "python": platform.python_version(),
        "libraries": libraries,
    }
