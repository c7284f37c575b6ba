"""Checkpoint save and verification time against checkpoint size and rank count, measured.

Starts 1, 2 and 4 gloo ranks (torch.multiprocessing, CPU). Each rank writes a shard of --mib MiB
into the staging directory (as dist_checkpointing and DeepSpeed write one or more files per rank),
so that the checkpoint grows with the ranks, then toolkit.train.checkpoint publishes it (every
rank checksums its share of the files, rank 0 merges the manifest) and verifies it as a resume
does (every rank verifies its share). For each rank count and checkpoint.verify level it prints
the seconds of the write, of the checksums at save and of the verification at resume, and, as
the reference in the same invocation, rank 0 checksumming every file alone (what parakit did
before: one process over the whole checkpoint) with the ratio.

    python scripts/bench_checkpoint.py [--mib 256] [--ranks 1,2,4] [--levels xxh3,sha256,crc32,size]

Page cache: the files were just written, so reads come from memory: these are the hashing costs,
the floor under what a parallel filesystem adds. Ranks beyond the machine's cores time-share them.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from toolkit.train import checkpoint as ckpt

NO_FAULTS = SimpleNamespace(crash_in_save_at_step=None, corrupt_checkpoint_at_step=None)


def _rank(rank: int, world: int, port: int, root: str, mib: int, level: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shard = np.random.default_rng(rank).integers(0, 255, mib << 20, dtype=np.uint8)

    def write(staging: Path) -> None:
        shard.tofile(staging / f"shard_{rank:05d}.bin")
        os.sync()  # the write is measured to the disk, not to the page cache

    held = ckpt.save_collectively(Path(root), 1, 1, NO_FAULTS, write, {"step": 1}, {}, level)
    dist.barrier()
    started = time.perf_counter()
    found, _, _ = ckpt.load_collectively(Path(root), level, lambda candidate: None)
    verified = time.perf_counter() - started
    assert found is not None
    if rank == 0:
        manifest = ckpt.listed_files(found)[0]
        import json

        recorded = json.loads((found / ckpt.MANIFEST).read_text())
        started = time.perf_counter()
        assert ckpt.verify(found, level) is None  # the reference: rank 0 alone over every file
        alone = time.perf_counter() - started
        out.put(
            dict(
                world=world,
                level=level,
                files=len(manifest),
                gib=sum(e["bytes"] for e in manifest.values()) / 2**30,
                save=held,
                write=recorded["write_seconds"],
                checksum=recorded["checksum_seconds"],
                verify=verified,
                alone=alone,
            )
        )
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB each rank writes")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--levels", default="xxh3,sha256,crc32,size")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; {args.mib} MiB per rank")
    print(
        f"{'ranks':>5} {'level':>6} {'GiB':>5} {'write s':>8} {'checksum s':>10} {'verify s':>9} "
        f"{'rank 0 alone s':>14} {'alone/verify':>12}"
    )
    context = mp.get_context("spawn")
    for world in map(int, args.ranks.split(",")):
        for level in args.levels.split(","):
            out = context.Queue()
            with tempfile.TemporaryDirectory(dir=Path.cwd()) as root:  # on disk, as checkpoints are
                mp.start_processes(
                    _rank, (world, _free_port(), root, args.mib, level, out), nprocs=world, start_method="spawn"
                )
                r = out.get()
            ratio = r["alone"] / r["verify"] if r["verify"] > 1e-3 else float("nan")
            print(
                f"{r['world']:>5} {r['level']:>6} {r['gib']:>5.2f} {r['write']:>8.2f} {r['checksum']:>10.2f} "
                f"{r['verify']:>9.2f} {r['alone']:>14.2f} {ratio:>12.2f}",
                flush=True,
            )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
