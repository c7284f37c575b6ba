"""Helpers of the multi-process training tests: run `parakit train` in a subprocess and read
what the run left behind."""
import json
import os
import re
import subprocess
import sys
import time

from toolkit.config.store import compose_config
from toolkit.plan.checkpoint import checkpoint_plan
from toolkit.plan.layout import resolve


def run(tmp_path, name, *overrides, timeout=600):
    """`parakit train OVERRIDES` in tmp_path/name; the result carries .seconds and .run_dir."""
    run_dir = tmp_path / name
    started = time.monotonic()
    env = {**os.environ, "PARAKIT_DIST_TIMEOUT_S": "180"}
    result = subprocess.run([sys.executable, "-m", "toolkit.cli", "train", *overrides, f"hydra.run.dir={run_dir}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=timeout, env=env)
    result.seconds = time.monotonic() - started
    result.run_dir = run_dir
    return result


def train(tmp_path, name, *overrides, timeout=900) -> list[float]:
    """A run that must complete: its loss curve."""
    result = run(tmp_path, name, *overrides, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return losses(result)


def losses(result) -> list[float]:
    assert (result.run_dir / "result.json").exists(), result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads((result.run_dir / "result.json").read_text())["losses"]


def records(result) -> list[dict]:
    return [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]


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
    assert every in {checkpoint_plan(cfg, resolve(cfg), step_seconds + e).recommended_steps for e in (-printed_to, 0, printed_to)}
    steps = cfg.train.steps
    assert saved_steps(result) == sorted({1, steps, *range(every, steps + 1, every)})


# The planner's interval rule on a short run: a rework bound of 3 s gives, with ~1 s steps, a save
# every few steps.
AUTO_INTERVAL = ["checkpoint.interval_steps=null", "checkpoint.auto_interval=true", "checkpoint.keep_last=10",
                 "train.steps=8", "checkpoint.acceptable_rework_minutes=0.025"]
