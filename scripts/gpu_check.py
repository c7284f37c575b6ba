"""Train a ~1B model for a few dozen steps in bf16 on one GPU and print the measured throughput,
MFU and peak memory beside the planner's prediction for the same layout.

    python scripts/gpu_check.py                       # llama3_1b on 1xh200, 30 steps, bf16
    python scripts/gpu_check.py --model tiny --cluster cpu --precision fp32 --seq 128 --steps 4   # plumbing on CPU

The first steps (warm-up, allocator growth) are left out of the throughput median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--cluster", default="1xh200")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    parser.add_argument("overrides", nargs="*", help="further Hydra overrides")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="parakit-gpu-check-"))
    overrides = [
        f"model={args.model}",
        f"cluster={args.cluster}",
        "cluster.gpus_per_node=1",
        "cluster.nodes=1",
        f"precision={args.precision}",
        "parallel=dp",
        "zero=1",
        "data=synthetic",
        f"train.steps={args.steps}",
        f"train.global_batch={args.global_batch}",
        f"train.micro_batch={args.micro}",
        f"model.seq_length={args.seq}",
        "optim.warmup_steps=1",
        f"train.log_interval={max(1, args.steps // 6)}",
        f"hydra.run.dir={run_dir}",
        *args.overrides,
    ]
    print("parakit train " + " ".join(overrides), flush=True)
    if subprocess.run([sys.executable, "-m", "toolkit.cli", "train", *overrides]).returncode != 0:
        return 1
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = records[args.skip :] or records
    tokens = statistics.median(r["tokens_per_s"] for r in measured)
    mfu = statistics.median(r["mfu"] for r in measured)
    step = statistics.median(r["step_time_s"] for r in measured)
    memory = max(r["memory_gib"] for r in records)
    predicted_step, predicted_memory = records[-1]["predicted_step_time_s"], records[-1]["predicted_memory_gib"]
    predicted_tokens = tokens * step / predicted_step
    print(
        f"\n{args.model} on {args.cluster}, {args.precision}, micro {args.micro} x {args.global_batch // args.micro} "
        "accum, "
        f"seq {args.seq}: median of steps {args.skip + 1}-{len(records)}"
    )
    print(
        f"  step time   measured {step:8.3f} s    planner {predicted_step:8.3f} s    ratio {step / predicted_step:5.2f}"
    )
    print(
        f"  tokens/s    measured {tokens:8,.0f}      planner {predicted_tokens:8,.0f}      ratio "
        f"{tokens / predicted_tokens:5.2f}"
    )
    print(f"  MFU         measured {mfu:8.1%}      planner {mfu * step / predicted_step:8.1%}")
    print(
        f"  peak memory measured {memory:8.2f} GiB  planner {predicted_memory:8.2f} GiB  ratio "
        f"{memory / predicted_memory:5.2f}"
    )
    print(f"  losses: first {records[0]['loss']:.3f}, last {records[-1]['loss']:.3f}; run directory {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
