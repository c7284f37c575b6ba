"""Checkpoint save and load through each backend against the disk's own speed, at 1, 2 and 4 ranks.

For each rank count and backend, `parakit train` (CPU ranks, data parallel, ZeRO-1, fp32) trains
one step and saves; a second run resumes from that checkpoint. Just before each save the same
number of bytes is written raw (each rank its share at once: one file, written and fsynced, as
dd conv=fdatasync measures the disk) and read back, in the same invocation. Prints, per row:
- the checkpoint's size and the largest share one rank wrote (ratio to total/ranks);
- save seconds (what training was held up: every rank's writes and checksums, the manifest's
  figures) against the raw write: raw/save, goal >= 0.7;
- load seconds (result.json: finding, verifying and loading it) against the raw read: goal >= 0.7;
- the largest peak extra host memory one rank's write held (the manifest, sampled every 2 ms)
  against that rank's share of the checkpoint: goal <= 1.1.

    python scripts/bench_save.py [--ranks 1,2,4] [--backends megatron,deepspeed] [-- OVERRIDES]

Before the raw read and before the resuming run the page cache is dropped (as root on Linux;
--warm, or without root, both read files just written from memory instead). The disk's speed
varies from one minute to the next on shared machines: compare within a row.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODEL = [  # ~130M parameters: a 2 GB fp32 checkpoint with Adam
    "model=tiny",
    "model.num_layers=4",
    "model.hidden_size=1024",
    "model.ffn_hidden_size=4096",
    "model.num_attention_heads=16",
    "model.num_kv_heads=4",
    "model.vocab_size=32000",
    "data=synthetic",
]
RUN = ["cluster=cpu", "precision=fp32", "zero=1", "train.micro_batch=1", "checkpoint.interval_steps=1"]
# Which rank wrote a file: dist_checkpointing's __RANK_THREAD.distcp, DeepSpeed's
# zero_pp_rank_RANK_..., the random states' rank_RANK.pt; the rest (metadata, DeepSpeed's model
# states) rank 0.
RANK_OF_FILE = re.compile(r"__(\d+)_\d+\.distcp$|zero_pp_rank_(\d+)_|/rank_(\d+)\.pt$")


def _raw_rank(path: str, nbytes: int, write: bool, start, out) -> None:
    data = np.random.default_rng(len(path)).integers(0, 255, nbytes, dtype=np.uint8) if write else None
    start.wait()
    began = time.perf_counter()
    if write:
        with open(path, "wb") as f:
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
    else:
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    out.put((began, time.perf_counter()))


def _ranks_at_once(folder: Path, ranks: int, total: int, write: bool) -> float:
    """Wall seconds of `ranks` processes each writing (or reading) its total/ranks bytes at once."""
    context = mp.get_context("spawn")
    start, out = context.Barrier(ranks), context.Queue()
    procs = [
        context.Process(target=_raw_rank, args=(str(folder / f"raw_{r}"), total // ranks, write, start, out))
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    times = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return max(t[1] for t in times) - min(t[0] for t in times)


def drop_page_cache() -> bool:
    """Empty the kernel's page cache (root on Linux), so that the next reads come from the disk."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def raw_seconds(folder: Path, ranks: int, total: int, cold: bool) -> tuple[float, float]:
    """(write, read) wall seconds of the ranks writing, then reading back, total bytes."""
    write = _ranks_at_once(folder, ranks, total, write=True)
    if cold:
        drop_page_cache()
    read = _ranks_at_once(folder, ranks, total, write=False)
    for r in range(ranks):
        (folder / f"raw_{r}").unlink()
    return write, read


def train(folder: Path, name: str, overrides: list[str]) -> dict:
    command = [sys.executable, "-m", "toolkit.cli", "train", *overrides, f"hydra.run.dir={folder / name}"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads((folder / name / "result.json").read_text())


def per_rank_bytes(manifest: dict) -> dict[int, int]:
    written: dict[int, int] = {}
    for name, entry in manifest["files"].items():
        match = RANK_OF_FILE.search(name)
        rank = int(next((g for g in match.groups() if g), 0)) if match else 0
        written[rank] = written.get(rank, 0) + entry["bytes"]
    return written


def measure(folder: Path, backend: str, ranks: int, extra: list[str], cold: bool) -> dict:
    checkpoints = folder / f"{backend}_{ranks}_checkpoints"
    overrides = [
        *MODEL,
        *RUN,
        f"backend={backend}",
        f"cluster.gpus_per_node={ranks}",
        f"train.global_batch={ranks}",
        f"checkpoint.dir={checkpoints}",
        *extra,
    ]
    # the raw reference first, at the size of this configuration's checkpoint (a dry save: the
    # first run's), so that both see the disk within the same minute
    train(folder, f"{backend}_{ranks}_save", [*overrides, "train.steps=1"])
    manifest = json.loads((checkpoints / "step_00000001" / "manifest.json").read_text())
    total = sum(e["bytes"] for e in manifest["files"].values())
    raw_write, raw_read = raw_seconds(folder, ranks, total, cold)
    saved = train(folder, f"{backend}_{ranks}_again", [*overrides, "train.steps=2", "checkpoint.interval_steps=2"])
    manifest = json.loads((checkpoints / "step_00000002" / "manifest.json").read_text())
    if cold:
        drop_page_cache()
    resumed = train(folder, f"{backend}_{ranks}_resume", [*overrides, "train.steps=2"])
    written = per_rank_bytes(manifest)
    share = total / ranks
    save = manifest["write_seconds"] + manifest["checksum_seconds"]
    return dict(
        backend=backend,
        ranks=ranks,
        gb=total / 1e9,
        most_written=max(written.values()) / share,
        save=save,
        raw_write=raw_write,
        load=resumed["resume_load_seconds"],
        raw_read=raw_read,
        held=max(manifest["write_peak_extra_bytes"]) / share,
        resumed=saved["resumed_step"] == 1 and resumed["resumed_step"] == 2,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--backends", default="megatron,deepspeed")
    parser.add_argument("overrides", nargs="*", help="further Hydra overrides (after --)")
    parser.add_argument("--warm", action="store_true", help="reads from the page cache (no drop)")
    args = parser.parse_args()
    cold = not args.warm and drop_page_cache()
    reads = "from the disk (page cache dropped)" if cold else "from the page cache (not dropped: --warm or not root)"
    print(f"{os.cpu_count()} cores; checkpoint.verify as configured (xxh3 unless overridden); reads {reads}")
    print(
        f"{'backend':>9} {'ranks':>5} {'GB':>5} {'max rank/share':>14} {'save s':>7} {'raw write s':>11} "
        f"{'raw/save':>8} {'load s':>7} {'raw read s':>10} {'raw/load':>8} {'held/share':>10}"
    )
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as root:  # on disk, as checkpoints are
        for ranks in map(int, args.ranks.split(",")):
            for backend in args.backends.split(","):
                r = measure(Path(root), backend, ranks, args.overrides, cold)
                assert r["resumed"], f"{backend} at {ranks} ranks did not resume from its checkpoints"
                print(
                    f"{r['backend']:>9} {r['ranks']:>5} {r['gb']:>5.2f} {r['most_written']:>14.2f} "
                    f"{r['save']:>7.2f} {r['raw_write']:>11.2f} {r['raw_write'] / r['save']:>8.2f} "
                    f"{r['load']:>7.2f} {r['raw_read']:>10.2f} {r['raw_read'] / r['load']:>8.2f} {r['held']:>10.2f}",
                    flush=True,
                )
                for run in Path(root).glob(f"{backend}_{ranks}_*"):  # the next row's disk space
                    subprocess.run(["rm", "-rf", str(run)], check=True)


if __name__ == "__main__":
    main()
