"""`parakit sweep` on CPU: a grid over both backends and 1-2 ranks, trained, measured and recorded
beside the planner's predictions; invalid points never start, a crashing point is recorded and
the sweep goes on, and running the same sweep again skips what is recorded."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SHORT = ["data=synthetic", "train.steps=4", "train.global_batch=4", "model.num_layers=4", "--warmup-steps", "1"]
GRID = ["backend=megatron,deepspeed", "cluster.gpus_per_node=1,2", "parallel.tp=1,2"]


def sweep(directory, *args):
    command = [sys.executable, "-m", "toolkit.cli", "sweep", *args, f"hydra.sweep.dir={directory}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=directory.parent)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sweeps") / "grid"
    first = sweep(directory, *SHORT, *GRID)
    crash = sweep(directory, *SHORT, "cluster.gpus_per_node=1", "train.fault.kill_rank=0", "train.fault.kill_at_step=2")
    again = sweep(directory, *SHORT, *GRID)
    return directory, first, crash, again


def rows(directory) -> dict:
    return {r["point"]: r for r in json.loads((directory / "sweep.json").read_text())["points"]}


def test_every_point_is_recorded_with_measured_and_predicted_figures(swept):
    directory, first, _, _ = swept
    assert first.returncode == 0, first.stderr[-3000:]
    recorded = rows(directory)
    assert len(recorded) == 9  # 8 grid points + the crashing one
    assert len({r["run_dir"] for r in recorded.values()}) == 9  # each point its own directory
    ok = [r for r in recorded.values() if r["status"] == "ok"]
    invalid = [r for r in recorded.values() if r["status"] == "invalid"]
    # tp=2 on one rank, and tp on deepspeed (no tensor parallel there), never start
    assert len(ok) == 5 and len(invalid) == 3, {k: r["status"] for k, r in recorded.items()}
    assert all("[" in r["error"] and "Fix:" in r["error"] for r in invalid)
    for r in ok:
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["memory_gib"] > 0
        assert r["predicted_step_time_s"] > 0 and r["predicted_memory_gib"] > 0 and r["final_loss"] > 0
    assert {(r["backend"], r["world_size"], r["tp"]) for r in ok} == {
        ("megatron", 1, 1),
        ("megatron", 2, 1),
        ("megatron", 2, 2),
        ("deepspeed", 1, 1),
        ("deepspeed", 2, 1),
    }
    with open(directory / "sweep.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 9 and {"step_time_s", "predicted_step_time_s", "mfu", "status"} <= set(table[0])
    assert "sweep point 8/8" in first.stdout and "left" in first.stdout


def test_a_crashing_point_is_recorded_and_a_rerun_skips_recorded_points(swept):
    directory, first, crash, again = swept
    assert crash.returncode == 0, crash.stderr[-3000:]
    (failed,) = [r for r in rows(directory).values() if "kill_at_step=2" in r["point"]]
    assert failed["status"] == "failed" and failed["error"], failed
    assert again.returncode == 0 and again.stdout.count("skipped (recorded before)") == 8, again.stdout[-2000:]
    assert len(rows(directory)) == 9


def test_report_draws_the_real_sweep(swept, tmp_path):
    """`parakit report` on this sweep (tests/test_report.py covers the cases by hand-made sweeps)."""
    from toolkit.cli import main

    assert main(["report", str(swept[0]), "--output", str(tmp_path)]) == 0
    assert {p.stem for p in tmp_path.glob("*.png")} == {"throughput", "efficiency", "predicted_vs_measured", "loss"}
    table = [line for line in (tmp_path / "report.md").read_text().splitlines() if line.startswith("| P")]
    assert len(table) == 9 and "data:image/png;base64," in (tmp_path / "report.html").read_text()
