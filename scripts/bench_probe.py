"""The planner on the machine at hand: predicted against measured step time, with the constants
`parakit probe` measured and no fitting to any training run.

    python scripts/bench_probe.py [--steps 10] [--keep DIR] [--json OUT] [--force-probe]

Runs, in one invocation:
1. `parakit probe` (the cached figures, or new ones with --force-probe): the default cpu cluster's
   constants.
2. A 6-point sweep of the main job (`recipe=tiny_cpu_demo`: the tiny model on 4 CPU ranks, real
   corpus) over layouts and both backends: megatron dp4, tp2 x dp2, pp2 x dp2, tp2 x pp2 x vpp2
   (the main job's own layout), DeepSpeed dp4 and pp2 x dp2. Each point's measured step time is
   the median after the warm-up steps; its prediction is the planner's for the configuration it
   trained (the run directory's config.yaml holds the probed constants).
3. `parakit calibrate` on that sweep: each point predicted by a fit to the others (held out).

Goals (issue: a planner right on this machine): the main job within 25%, the sweep's median
|error| within 15%, and the calibrated held-out median within 10%. The summary says which are met.

The machine's own speed (2 s of one thread's GEMM, with nothing else of the benchmark running) is
taken before the probe, after it and after each sweep, and printed beside the errors: on a shared
VM it moves by more than the goals within minutes, and the probe's figures are of other minutes
than the sweep's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GRIDS = (
    ["backend=megatron", "parallel=dp,tp2,pp2,tp2_pp2_vpp2"],
    ["backend=deepspeed", "parallel=dp,pp2"],
)
MAIN_JOB = "tp2_pp2_vpp2"
GOALS = {"main job": 0.25, "sweep median": 0.15, "calibrated held-out median": 0.10}


def machine_speed(seconds: float = 2.0) -> float:
    """GFLOP/s of one thread's 256^3 fp32 GEMM over `seconds`, with nothing else of this benchmark
    running (the machine's own speed of the moment)."""
    import torch

    torch.set_num_threads(1)
    a, b, out = torch.randn(256, 256), torch.randn(256, 256), torch.empty(256, 256)
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        torch.mm(a, b, out=out)
        calls += 1
    return 2 * 256**3 * calls / (time.perf_counter() - started) / 1e9


def parakit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", "import sys; from toolkit.cli import main; sys.exit(main())", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per sweep point (default 10)")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--keep", metavar="DIR", help="sweep here (default: a temporary directory)")
    parser.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    parser.add_argument("--force-probe", action="store_true", help="measure the machine again")
    opts = parser.parse_args()

    from toolkit.config import machine
    from toolkit.plan.calibrate import calibrate
    from toolkit.report.calibrate import load_points

    speeds = {"start": machine_speed()}
    probe = machine.run_probe(force=opts.force_probe)
    speeds["after the probe"] = machine_speed()
    print(
        f"machine: {probe['fingerprint']['processor']}, {probe['fingerprint']['cores']} cores (probe cached in "
        f"{machine.cache_path()})",
        flush=True,
    )
    root = Path(opts.keep or tempfile.mkdtemp(prefix="bench-probe-"))
    root.mkdir(parents=True, exist_ok=True)
    sweep_dir = root / "sweep"
    for grid in GRIDS:
        done = parakit(
            "sweep",
            "recipe=tiny_cpu_demo",
            f"train.steps={opts.steps}",
            *grid,
            "--warmup-steps",
            str(opts.warmup_steps),
            f"hydra.sweep.dir={sweep_dir}",
            cwd=root,
        )
        print("\n".join(line for line in done.stdout.splitlines() if "sweep point" in line), flush=True)
        speeds[f"after the {grid[0].split('=')[1]} sweep"] = machine_speed()
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
    points = load_points(sweep_dir)
    rows = json.loads((sweep_dir / "sweep.json").read_text())["points"]
    predicted = {r["point"]: r["predicted_step_time_s"] for r in rows if r["status"] == "ok"}
    print(f"\n{'point':<72}{'measured s':>11}{'predicted s':>12}{'error':>8}")
    errors = {}
    for p in points:
        errors[p.name] = predicted[p.name] / p.measured - 1
        print(f"{p.name:<72}{p.measured:>11.3f}{predicted[p.name]:>12.3f}{errors[p.name]:>+8.1%}")
    (main_job,) = [name for name in errors if f"parallel={MAIN_JOB}" in name]
    calibration = calibrate(points)
    figures = {
        "main job": abs(errors[main_job]),
        "sweep median": statistics.median(map(abs, errors.values())),
        "calibrated held-out median": calibration.median_after,
    }
    print()
    for name, value in figures.items():
        verdict = "met" if value <= GOALS[name] else "MISSED"
        print(f"{name:<28} |error| {value:6.1%}   goal {GOALS[name]:.0%}: {verdict}")
    listing = ", ".join(f"{when} {gflops:.0f}" for when, gflops in speeds.items())
    spread = max(speeds.values()) / min(speeds.values())
    print(f"machine speed (one thread's GEMM, GFLOP/s): {listing}; fastest/slowest {spread:.2f}x")
    if opts.json:
        record = {"machine": probe["fingerprint"], "errors": errors, "figures": figures, "speed_gflops": speeds}
        Path(opts.json).write_text(json.dumps(record, indent=1))
    return 0 if all(v <= GOALS[n] for n, v in figures.items()) else 3


if __name__ == "__main__":
    sys.exit(main())
