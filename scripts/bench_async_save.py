"""How long a checkpoint holds training up, synchronous against asynchronous save (megatron
backend): the same run twice in one invocation, saving every few steps; prints the seconds each
save blocked the training loop, the whole run's wall time, and the ratios (async / sync).

    python scripts/bench_async_save.py                 # CPU: a 8-layer, 512-wide model on 2 ranks (pp=2)
    python scripts/bench_async_save.py --preset cpu-1b # CPU: llama3_1b cut to 2 layers, one rank (3 GB saves)
    python scripts/bench_async_save.py --gpu           # llama3_1b, bf16, on one H200
    python scripts/bench_async_save.py -- parallel.tp=2 # further Hydra overrides after --

The first save of each run (process start-up, file creation) is left out of the mean.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CPU = [
    "model=tiny",
    "model.hidden_size=512",
    "model.ffn_hidden_size=1536",
    "model.num_attention_heads=8",
    "model.num_kv_heads=4",
    "precision=fp32",
    "cluster=cpu",
    "cluster.gpus_per_node=2",
    "parallel.pp=2",
    "zero=1",
    "train.steps=12",
    "train.global_batch=8",
    "train.micro_batch=1",
    "checkpoint.interval_steps=3",
]
CPU_1B = [  # the 2-layer llama3_1b of the checkpoint measurements, fp32 on one CPU rank
    "model=llama3_1b",
    "model.num_layers=2",
    "model.vocab_size=32000",
    "model.seq_length=256",
    "precision=fp32",
    "cluster=cpu",
    "cluster.gpus_per_node=1",
    "zero=1",
    "train.steps=12",
    "train.global_batch=1",
    "train.micro_batch=1",
    "checkpoint.interval_steps=3",
]
GPU = [
    "model=llama3_1b",
    "cluster=1xh200",
    "cluster.gpus_per_node=1",
    "precision=bf16",
    "parallel=dp",
    "zero=1",
    "model.seq_length=2048",
    "train.steps=20",
    "train.global_batch=16",
    "train.micro_batch=4",
    "checkpoint.interval_steps=5",
]


def train(run_dir: Path, overrides: list[str]) -> tuple[list[float], float]:
    command = [
        sys.executable,
        "-m",
        "toolkit.cli",
        "train",
        *overrides,
        "data=synthetic",
        "optim.warmup_steps=1",
        "checkpoint.keep_last=2",
        f"hydra.run.dir={run_dir}",
    ]
    print("parakit train " + " ".join(command[4:]), flush=True)
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if result.returncode != 0:
        sys.exit(f"the run failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    held_up = [float(s) for s in re.findall(r"training held up ([\d.]+) s", result.stdout)]
    return held_up, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=("cpu", "cpu-1b", "gpu"), default="cpu")
    parser.add_argument("--gpu", action="store_true", help="the H200 preset (--preset gpu)")
    parser.add_argument("overrides", nargs="*", help="further Hydra overrides")
    args = parser.parse_args()
    preset = {"cpu": CPU, "cpu-1b": CPU_1B, "gpu": GPU}["gpu" if args.gpu else args.preset]
    overrides = [*preset, *args.overrides]
    root = Path(tempfile.mkdtemp(prefix="parakit-async-save-"))
    sync_saves, sync_seconds = train(root / "sync", overrides)
    async_saves, async_seconds = train(root / "async", [*overrides, "checkpoint.async_save=true"])
    sync_mean = statistics.mean(sync_saves[1:] or sync_saves)
    async_mean = statistics.mean(async_saves[1:] or async_saves)
    print(f"\nsaves per run: {len(sync_saves)}; run directories under {root}")
    print(
        f"  training held up per save   sync {sync_mean:8.3f} s   async {async_mean:8.3f} s   ratio "
        f"{async_mean / sync_mean:5.2f}"
    )
    print(
        f"  whole run (incl. start-up)  sync {sync_seconds:8.1f} s   async {async_seconds:8.1f} s   ratio "
        f"{async_seconds / sync_seconds:5.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
