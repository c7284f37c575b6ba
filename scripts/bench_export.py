"""Peak memory of `parakit export` against the size of the model it writes: the export runs in a
child process whose resident memory is sampled every 10 ms (anonymous memory, and all of it:
memory-mapped checkpoint files count there while their pages are resident, but the kernel can
drop them), and its start-up alone (imports) is measured the same way.

    python scripts/bench_export.py RUN_DIR [--max-shard-size 200MB] [--step N]

The streaming claim: peak minus start-up stays near one shard plus one layer (the largest
tensor, the embedding, counts as a layer), whatever the model's size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

# What the export imports before its first tensor (and the model class it builds on the meta device).
_STARTUP = "import toolkit.interop.export, toolkit.interop.readers, safetensors.torch, transformers.models.llama"


def _peak(command: list[str]) -> tuple[float, float, float]:
    """(peak RSS, peak anonymous RSS in bytes, seconds) of `command`."""
    started = time.monotonic()
    child = psutil.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = peak_anon = 0
    while child.poll() is None:
        try:
            info = child.memory_full_info()
        except psutil.Error:
            break
        peak = max(peak, info.rss)
        peak_anon = max(peak_anon, info.rss - info.shared)  # shared: file-backed pages (mmap, libraries)
        time.sleep(0.01)
    _, err = child.communicate()
    if child.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{err.decode()[-2000:]}")
    return peak, peak_anon, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--max-shard-size", default="200MB")
    parser.add_argument("--step", type=int)
    args = parser.parse_args()
    gib = 2**30
    deepspeed = any(args.run_dir.glob("**/state"))
    base, base_anon, _ = _peak([sys.executable, "-c", _STARTUP + (", deepspeed" if deepspeed else "")])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hf"
        command = [sys.executable, "-m", "toolkit.cli", "export", str(args.run_dir), "--output", str(out)]
        command += ["--max-shard-size", args.max_shard_size, "--no-tokenizer"]
        command += ["--step", str(args.step)] if args.step else []
        peak, peak_anon, seconds = _peak(command)
        summary = json.loads((out / "parakit_export.json").read_text())
        model_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(
        f"{summary['backend']} step {summary['step']}: {summary['parameters']:,} parameters, "
        f"{model_bytes / gib:.2f} GiB in {len(summary['shards'])} shard(s) of <= {args.max_shard_size}; "
        f"{seconds:.0f} s\n"
        f"peak RSS {peak / gib:.2f} GiB (anonymous {peak_anon / gib:.2f} GiB); start-up alone {base / gib:.2f} GiB "
        f"(anonymous {base_anon / gib:.2f}); above start-up: {(peak - base) / gib:.2f} GiB "
        f"(anonymous {(peak_anon - base_anon) / gib:.2f}) = {(peak - base) / model_bytes:.2f} x the model"
    )


if __name__ == "__main__":
    main()
