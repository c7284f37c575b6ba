"""Both backends run the same learning-rate schedule: megatron-core's OptimizerParamScheduler with
the emitted arguments and a real DeepSpeed engine with the emitted JSON and the trainer's
scheduler give the same learning rate at every step, exactly, over cosine/linear/constant decay,
with and without warmup, with a decay shorter than the run, with a rescaled learning rate and
across gradient accumulation. (Before, DeepSpeed's WarmupCosineLR ran the warmup a step late and
never reached the peak: 0, 0, 5e-4, 8.68e-4, ... against megatron-core's 0, 5e-4, 1e-3, 8.68e-4.)"""

import itertools
import json
import subprocess
from pathlib import Path

import pytest
from training_runs import python

from toolkit.config.store import compose_config
from toolkit.plan.layout import resolve
from toolkit.plan.lr_schedule import lr_schedule

BASE = [
    "model=tiny",
    "cluster.gpus_per_node=1",
    "zero=1",
    "train.steps=9",
    "train.global_batch=2",
    "train.micro_batch=1",
    "optim.lr=1e-3",
]
CASES = [
    [
        *BASE,
        f"optim.decay_style={style}",
        f"optim.warmup_steps={warmup}",
        f"optim.decay_steps={decay}",
        f"optim.min_lr={min_lr}",
    ]
    for style, warmup, decay, min_lr in itertools.product(
        ["cosine", "linear", "constant"], [0, 1, 3], ["null", 5], [0.0, 1e-4]
    )
]
ISSUE_EXAMPLE = [*BASE, "train.steps=6", "optim.warmup_steps=2", "optim.decay_style=cosine", "optim.min_lr=1e-4"]
RESCALED = [
    *BASE,
    "train.global_batch=8",
    "optim.lr_scaling=sqrt",
    "optim.reference_global_batch=2",
    "optim.warmup_steps=8",
    "optim.decay_steps=7",
]


@pytest.fixture(scope="module")
def schedules():
    cases = [*CASES, ISSUE_EXAMPLE, RESCALED]
    script = Path(__file__).parent / "dist" / "lr_schedules.py"
    result = subprocess.run(
        [python(), str(script), "29541"], input=json.dumps(cases), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    return {
        tuple(case): (megatron, deepspeed)
        for case, megatron, deepspeed in zip(cases, out["megatron"], out["deepspeed"])
    }


@pytest.mark.parametrize(
    "case", [*CASES, RESCALED], ids=lambda case: "-".join(o.split("=")[1] for o in case[len(BASE) :])
)
def test_deepspeed_and_megatron_apply_the_same_learning_rate_at_every_step(schedules, case):
    megatron, deepspeed = schedules[tuple(case)]
    assert deepspeed == megatron  # exactly
    cfg = compose_config(case)
    assert megatron == [lr_schedule(cfg, resolve(cfg)).lr(step) for step in range(len(megatron))]


def test_warmup_reaches_the_peak_and_cosine_decays_from_it(schedules):
    megatron, deepspeed = schedules[tuple(ISSUE_EXAMPLE)]
    expected = [0.0, 5e-4, 1e-3, 8.682e-4, 5.5e-4, 2.318e-4]
    assert megatron == pytest.approx(expected, abs=1e-7) and deepspeed == megatron
