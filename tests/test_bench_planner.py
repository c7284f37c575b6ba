"""scripts/bench_planner.py runs (it is no test's subject otherwise, and once broke unseen): every
published run is predicted, each row's layout multiplies into its GPUs, and the error is the
signed ratio of the two figures (positive: the planner predicts more throughput)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from toolkit.plan.parallel_dims import parse_degrees

ROOT = Path(__file__).parents[1]


def test_every_published_run_is_predicted_and_its_error_follows_from_its_figures(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_planner.py"), "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    runs = yaml.safe_load((ROOT / "scripts" / "data" / "published_runs.yaml").read_text())["runs"]
    assert [r["id"] for r in rows] == [r["id"] for r in runs]
    for r in rows:
        sizes = parse_degrees("_".join(r["layout"].split()))
        assert sizes["tp"] * sizes["pp"] * sizes["cp"] * sizes["dp"] == r["gpus"], r["id"]
        faster = r["published"] / r["predicted"] if r["metric"] == "step_time_s" else r["predicted"] / r["published"]
        assert r["predicted"] > 0 and abs(r["error"] - (faster - 1)) < 1e-12, r["id"]
    assert f"of {len(rows)} runs within" in done.stdout
