"""Planner vs parakit's own runs on real GPUs: step time, tensor memory and reserved memory.

    python scripts/bench_measured.py [--points scripts/data/gpu_measured_points.yaml] [--json OUT] [--terms]

Each point of the data file (a run's machine, commit, overrides and measured figures) is composed
into the configuration it ran, and the planner's step time, peak tensor memory (what
torch.cuda.max_memory_allocated reports) and reserved memory (max_memory_reserved) are printed
beside the measured ones. `--terms` adds the step's terms (compute per micro-batch, the
optimizer, the per-step host work) and the memory's. The goal is every figure within 10%.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from toolkit.config.store import compose_config
from toolkit.plan.layout import resolve
from toolkit.plan.memory import GIB, peak_memory
from toolkit.plan.perf import estimate_step

DATA = Path(__file__).parent / "data" / "gpu_measured_points.yaml"
TOLERANCE = 0.10
FIGURES = (("step_time_s", "step s"), ("memory_gib", "tensors GiB"), ("reserved_gib", "reserved GiB"))


def predict(data: dict, point: dict) -> dict:
    machine = data["machines"][point["machine"]]
    cfg = compose_config([*data["common"], *machine["cluster"], *point["overrides"]])
    layout = resolve(cfg)
    step, memory = estimate_step(cfg, layout), peak_memory(cfg, layout)
    predicted = {
        "step_time_s": step.step_time,
        "memory_gib": memory.tensors / GIB,
        "reserved_gib": memory.reserved / GIB,
    }
    row = {"id": point["id"], "machine": point["machine"]}
    for key, _ in FIGURES:
        # error > 0: the planner predicts less than was measured (a faster step, less memory);
        # a figure the run did not record is left out
        if point.get(key) is not None:
            row[key] = {"measured": point[key], "predicted": predicted[key], "error": point[key] / predicted[key] - 1}
    row["terms"] = {
        "per_microbatch_s": step.stage_times[-1],
        "microbatches": layout.num_microbatches,
        "dp_comm_s": step.dp_comm,
        "optimizer_s": step.optimizer,
        "host_step_s": step.step_time - step.compute - step.dp_comm - step.pp_comm - step.optimizer,
    } | {f"{k}_gib": v for k, v in memory.as_gib().items()}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=Path, default=DATA)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--terms", action="store_true", help="print each prediction's terms too")
    args = parser.parse_args()
    data = yaml.safe_load(args.points.read_text())
    rows = [predict(data, point) for point in data["points"]]

    header = "".join(f" {label:>26}" for _, label in FIGURES)
    print(f"{'point':36}{header}")
    print(f"{'':36}" + "".join(f" {'measured':>9} {'planner':>8} {'err':>7}" for _ in FIGURES))
    errors = []
    for r in rows:
        cells = ""
        for key, _ in FIGURES:
            f = r.get(key)
            if f is None:
                cells += f" {'-':>9} {'':>8} {'':>7} "
                continue
            errors.append(abs(f["error"]))
            flag = " " if abs(f["error"]) <= TOLERANCE else "*"
            cells += f" {f['measured']:>9.4g} {f['predicted']:>8.4g} {f['error']:>+6.1%}{flag}"
        print(f"{r['id']:36}{cells}")
        if args.terms:
            print("    " + ", ".join(f"{k} {v:.4g}" for k, v in r["terms"].items()))
    within = sum(e <= TOLERANCE for e in errors)
    errors.sort()
    median = errors[len(errors) // 2]
    print(
        f"{within} of {len(errors)} figures within {TOLERANCE:.0%}; median |error| {median:.1%}, worst {errors[-1]:.1%}"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
