"""Checkpoints that are never trusted half-written, whatever wrote their contents, and on disk
once published.

A save goes to `<root>/.step_00000042.partial` (every rank writes its shards there), then every
rank checksums its share of the files (checkpoint.verify: XXH3, SHA-256, CRC-32 or the size alone)
and fsyncs them in the same pass; rank 0 lists every file with its entry in manifest.json, fsyncs
the folders inside, renames the directory to `<root>/step_00000042` (atomic on one filesystem),
fsyncs `<root>`, points `<root>/latest` at it (a temporary file fsynced and renamed), and prunes
last (toolkit.train.checkpoint_retention). A power loss at any point leaves the previous
checkpoint, or the new one whole.
A resume checks every file of a candidate against its manifest (sizes, then each rank its share
of the checksums) before the backend reads anything from it: nothing is unpickled from a file
whose checksum has not been verified. A corrupt or unfinished newest checkpoint is reported,
set aside as `.step_00000042.rejected` (its files kept), and the previous good one is used; a
published step directory is never overwritten.
A checksum finds damage, not a forgery: whoever can write the files can write a matching manifest,
and the engines' formats that pickle (DeepSpeed's states, DCP's .metadata) run code when loaded.
Load checkpoints from sources you trust, as PyTorch's own documentation says of torch.load.
Where no checkpoint can be resumed, or checkpoint.resume=false finds an earlier run's, the run
refuses to start over (ResumeError) rather than train from step 0 over them.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, TypeVar

import xxhash

from toolkit.formats.atomic import durable_rename, fsync_path, fsync_tree, write_atomic
from toolkit.train import checkpoint_retention as retention

MANIFEST = "manifest.json"
T = TypeVar("T")
LATEST = "latest"
DEFAULT_LEVEL = "xxh3"


class ResumeError(RuntimeError):
    """A checkpoint that this run cannot resume from as configured: what and the fix."""


# The model fields that make a checkpoint's tensors (their shapes and meaning): a checkpoint of
# another model cannot be resumed, whatever the layout.
ARCHITECTURE = (
    "family", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "ffn_hidden_size",
    "vocab_size", "make_vocab_size_divisible_by", "normalization", "activation", "position_embedding",
    "tie_embeddings", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "moe",
)  # fmt: skip


def model_record(cfg) -> dict:
    """What a checkpoint records of the run that saved it: the backend and the model's architecture."""
    from toolkit.config.schema import plain

    model = plain(cfg.model)
    return {"backend": str(cfg.backend.name), **{name: model[name] for name in ARCHITECTURE}}


def _newest_state(root: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint under `root` whose trainer state reads, with it (an unreadable one the
    resume reports and passes over)."""
    for candidate in _candidates(root):
        try:
            return candidate, trainer_state(candidate)
        except (OSError, ValueError):
            continue
    return None


def other_model(cfg, root: Path) -> str | None:
    """(`parakit train`, before any rank starts) How the newest checkpoint under `root` differs from
    the configured backend and model ("hidden_size 64 saved, 128 configured"), or None: the same,
    none there, or one saved before checkpoints recorded it (the ranks' load then judges)."""
    newest = _newest_state(root)
    changed = model_changes(newest[1].get("model") if newest else None, cfg)
    return f"{newest[0]} holds another model: {changed}" if changed else None


def model_changes(saved: dict | None, cfg) -> str:
    """How the model record a checkpoint saved differs from the configured one ("hidden_size 64
    saved, 128 configured; ..."); "" when the same or nothing was recorded."""
    if not saved:
        return ""
    now = model_record(cfg)
    return "; ".join(f"{k} {saved.get(k)!r} saved, {v!r} configured" for k, v in now.items() if saved.get(k) != v)


def init_checkpoint_model(path: str | Path, cfg) -> str | None:
    """(`parakit train`, before any rank starts) How the model a sealed initial checkpoint holds
    differs from the configured one, or None (the same, or sealed before it recorded its model)."""
    try:
        saved = json.loads((Path(path) / MANIFEST).read_text()).get("model")
    except (OSError, ValueError, AttributeError):
        return None
    changed = model_changes({**saved, "backend": str(cfg.backend.name)} if saved else None, cfg)  # weights only
    return f"it holds another model: {changed}" if changed else None


def other_batch(cfg, root: Path) -> str | None:
    """(`parakit train`, before any rank starts) What changes when the newest checkpoint under
    `root` was trained at another global batch: the data is positioned by step (the samples the
    run would have read at this batch) and the learning-rate schedule counts steps, so neither
    continues from the samples consumed. None: the same batch, or nothing readable there."""
    newest = _newest_state(root)
    step, consumed = (newest[1].get("step"), newest[1].get("consumed_samples")) if newest else (None, None)
    if not step or not consumed or consumed == step * cfg.train.global_batch:
        return None
    return (
        f"{newest[0].name} was trained at global batch {consumed // step} ({consumed:,} samples by step {step}); "
        f"this run goes on at train.global_batch={cfg.train.global_batch}: its data starts at sample "
        f"{step * cfg.train.global_batch:,} and the learning-rate schedule at step {step}. Fix, to continue "
        f"exactly: train.global_batch={consumed // step}"
    )


def dist_checkpoint_problem(path: str | Path) -> str | None:
    """Why the megatron-core dist checkpoint in `path` (train.init_checkpoint: a folder
    train.save_init_checkpoint or `parakit convert hf-to-megatron` sealed) cannot be loaded, or
    None: it must have its manifest, and every file the manifest lists must be there with its size
    (nothing else). Reads sizes only, before any rank opens the files; the ranks verify the
    checksums before they read it (load_sealed). A folder without a manifest is refused: its
    .metadata is a pickle nothing vouches for."""
    if not (Path(path) / MANIFEST).is_file():
        return (
            f"no {MANIFEST}: parakit loads a megatron-core checkpoint only with the manifest it seals one with "
            "(its .metadata is a pickle, run when read)"
        )
    return verify(Path(path), "size")


def seal(directory: Path, saved_by: dict, level: str = DEFAULT_LEVEL) -> None:
    """(one process, its writes done) List every file of a staged folder in its manifest, each
    fsynced, with the model it holds (`saved_by`, model_record): what load_sealed verifies before
    anything reads it. Publish it with toolkit.formats.atomic.publish_directory."""
    files = {str(p.relative_to(directory)): file_entry(p, level, sync=True) for p in _files(directory)}
    write_atomic(directory / MANIFEST, json.dumps({"files": files, "model": saved_by}, indent=1))


def load_sealed(directory: Path, level: str, load: Callable[[Path], T]) -> T:
    """(every rank) `load` a sealed folder once every rank has verified its share of its files."""
    if problem := _verify_everywhere(directory, level):
        raise ResumeError(f"{directory} is damaged ({problem}); write it again")
    return _load_everywhere(directory, load)


@dataclass
class Resume:
    """Where a run starts: step 0, or the checkpoint it resumed from; and the newer checkpoints
    that failed verification on the way (result.json records all of it)."""

    step: int = 0
    checkpoint: str | None = None
    unusable: list[dict] = field(default_factory=list)
    load_seconds: float | None = None  # finding, verifying and loading it, on rank 0

    def record(self) -> dict:
        return {
            "resumed_from": self.checkpoint,
            "resumed_step": self.step,
            "resume_load_seconds": self.load_seconds,
            "unusable_checkpoints": self.unusable,
        }


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f".{step_name(step)}.partial"


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def prepare(root: Path, step: int) -> Path:
    """(rank 0) A clean staging directory for the save of `step`; staging folders that earlier
    saves left unfinished are removed."""
    staging = partial_dir(root, step)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    retention.remove_stale_staging(root, staging)
    return staging


def _blocks(path: Path, size: int = 1 << 22):
    """The file's bytes in blocks read into one reused buffer (no copy per block)."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            yield view[:count]


def _digest_of(new_hash) -> Callable[[Path], str]:
    def digest_of(path: Path) -> str:
        digest = new_hash()
        for block in _blocks(path):
            digest.update(block)
        return digest.hexdigest()

    return digest_of


def crc32_of(path: Path) -> str:
    value = 0
    for block in _blocks(path):
        value = zlib.crc32(block, value)
    return f"{value:08x}"


# checkpoint.verify: what a manifest records per file beside its size, and what a resume checks.
# xxh3 (XXH3-128, xxhash.com) catches accidental damage as well as any checksum but runs near the
# read's own speed (4.4 GB/s on one core here against SHA-256's 1.2: scripts/bench_checkpoint.py);
# sha256 is a cryptographic hash, but beside a manifest anyone can rewrite it proves no more;
# crc32 (zlib's) is kept for manifests that recorded it; size reads nothing but catches only
# truncated or missing files.
CHECKSUMS = {"xxh3": _digest_of(xxhash.xxh3_128), "sha256": _digest_of(hashlib.sha256), "crc32": crc32_of, "size": None}
RECORDED = [name for name, digest_of in CHECKSUMS.items() if digest_of is not None]


def file_entry(path: Path, level: str = DEFAULT_LEVEL, sync: bool = False) -> dict:
    """The manifest's entry of a file: its size and checksum at `level`; `sync` fsyncs it too (a
    save's files are on disk before the rename publishes them)."""
    entry = {"bytes": path.stat().st_size}
    if CHECKSUMS[level] is not None:
        entry[level] = CHECKSUMS[level](path)
    if sync:
        fsync_path(path)
    return entry


def share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The files `rank` checksums, out of `sizes` (name -> bytes): the largest first, each to the
    rank with the fewest bytes so far (greedy longest-processing-time), the same on every rank."""
    load, mine = [0] * world, []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        least = load.index(min(load))
        load[least] += sizes[name]
        if least == rank:
            mine.append(name)
    return mine


def publish(
    root: Path,
    step: int,
    keep_last: int,
    extra: dict | None = None,
    files: dict | None = None,
    level: str = DEFAULT_LEVEL,
    resumed_from: str | None = None,
) -> Path:
    """(rank 0, after every rank finished writing) The manifest, the folders fsynced, the atomic
    rename, `<root>` fsynced, `latest`, and pruning last (never `resumed_from`, the checkpoint this
    run resumed from). `files`: the entries every rank computed for its share, its files fsynced
    (else computed and fsynced here, at `level`)."""
    staging = partial_dir(root, step)
    if files is None:
        files = {str(p.relative_to(staging)): file_entry(p, level, sync=True) for p in _files(staging)}
    manifest = {"step": step, "sequence": retention.next_sequence(root), "files": dict(sorted(files.items()))}
    write_atomic(staging / MANIFEST, json.dumps({**manifest, **(extra or {})}, indent=1))
    fsync_tree(staging, files=False)  # the names in every folder of it (rng/, the engine's own)
    final = root / step_name(step)
    if final.exists():  # a checkpoint saved again (a conversion): the earlier one kept, never overwritten
        kept = retention.set_aside(final, "replaced")
        print(f"checkpoint {final.name} exists: kept as {kept}", file=sys.stderr, flush=True)
    durable_rename(staging, final)
    write_atomic(root / LATEST, final.name + "\n")
    retention.prune(root, keep_last, keep=(final, *([Path(resumed_from)] if resumed_from else [])))
    return final


def refuse_to_start_over(root: Path, unusable: list[dict]) -> None:
    """Raise ResumeError where a run would start at step 0 over checkpoints of an earlier run:
    every one of them unusable (`unusable`: what resume found), or checkpoint.resume=false
    (`unusable` None) with published checkpoints in `root`. Starting over is the user's call."""
    if unusable:
        listing = "; ".join(f"{u['checkpoint']}: {u['problem']}" for u in unusable)
        raise ResumeError(
            f"no checkpoint under {root} can be resumed ({listing}), and a run does not start over by itself. "
            "Fix: repair them, or move them out of that folder (or set checkpoint.dir to another one) to start "
            "from step 0"
        )
    published = sorted(p.name for p in root.glob("step_*")) if unusable is None and root.is_dir() else []
    if published:
        raise ResumeError(
            f"checkpoint.resume=false, and {root} holds checkpoints of an earlier run ({', '.join(published)}), "
            "which this run's saves would mix with. Fix: set checkpoint.dir to another folder, move them away, "
            "or set checkpoint.resume=true to continue from the newest"
        )


def listed_files(directory: Path) -> tuple[dict | None, str | None]:
    """The manifest's file entries, or why there are none."""
    manifest = directory / MANIFEST
    if not manifest.exists():
        return None, "no manifest (the save did not finish)"
    try:
        return json.loads(manifest.read_text())["files"], None
    except (ValueError, KeyError) as error:
        return None, f"unreadable manifest ({error})"


def verify(directory: Path, level: str = DEFAULT_LEVEL, names: list[str] | None = None) -> str | None:
    """None when every file the manifest lists (or `names` of them) is there with its size and,
    unless `level` is size, the checksum the manifest recorded, and (all of them asked) no file
    is there that it does not list; else why not."""
    listed, problem = listed_files(directory)
    if problem is None and names is None:
        problem = _unlisted(directory, listed)
    return problem or _verify_listed(directory, listed, level, names)


def _unlisted(directory: Path, listed: dict) -> str | None:
    """A file in the checkpoint that its manifest does not list: no save wrote it, nothing vouches for it."""
    extra = sorted(
        str(p.relative_to(directory)) for p in _files(directory) if str(p.relative_to(directory)) not in listed
    )
    return f"{extra[0]} is not in its manifest (added after the save)" if extra else None


def _verify_listed(directory: Path, listed: dict, level: str, names: list[str] | None = None) -> str | None:
    """`verify` against the manifest's entries already read."""
    for name in listed if names is None else names:
        expected, path = listed[name], directory / name
        if not path.exists():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['bytes']}"
        recorded = next((key for key in RECORDED if key in expected), None)
        if level != "size" and recorded and CHECKSUMS[recorded](path) != expected[recorded]:
            return f"{name} fails its {recorded} checksum"
    return None


def _candidates(root: Path) -> list[Path]:
    """Published checkpoints to resume from, the one published last first (its manifest's
    sequence: a save killed between its rename and `latest` is resumed, not the one before it);
    among checkpoints saved before manifests recorded a sequence, `latest` first, then by step."""
    if not root.exists():
        return []
    candidates = retention.published_in_order(root)[::-1]
    pointer = root / LATEST
    named = root / pointer.read_text().strip() if pointer.exists() else None
    if named in candidates and retention.sequence(named) == retention.sequence(candidates[0]) == -1:
        candidates = [named] + [c for c in candidates if c != named]
    return candidates


def find_resumable(
    root: Path, report=print, unusable: list | None = None, candidates: list[Path] | None = None, check=verify
) -> Path | None:
    """The newest checkpoint that verifies (`check`): `latest` first, then older ones, newest
    first (or `candidates`). Each one passed over is reported and, with `unusable`, listed there
    ({"checkpoint", "problem"})."""
    for candidate in _candidates(root) if candidates is None else candidates:
        problem = check(candidate)
        if problem is None:
            return candidate
        report(f"checkpoint {candidate} is not usable: {problem}; trying an older one")
        if unusable is not None:
            unusable.append({"checkpoint": candidate.name, "problem": problem})
    return None


def seed_host_rngs(seed: int) -> None:
    """Seed this process's python, numpy and torch generators (torch also seeds CUDA)."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def host_rng_state() -> dict:
    """This process's random generators: python, numpy, torch CPU and CUDA."""
    import random

    import numpy as np
    import torch

    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),  # a tuple of ints (and None or a float): weights_only loads it
        "numpy": (name, torch.from_numpy(keys.copy()), position, has_gauss, cached_gaussian),  # a tensor, not an array
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _numpy_array_globals() -> list:
    """What an array pickled by numpy needs under torch.load(weights_only=True) (PyTorch's own
    example in torch.serialization.add_safe_globals): states saved before the keys went in as a
    tensor."""
    import numpy as np

    return [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def set_host_rng_state(state: dict) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy() if isinstance(keys, torch.Tensor) else keys, *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_collectively(
    root: Path,
    step: int,
    keep_last: int,
    fault,
    write,
    trainer_state: dict,
    rng_state: dict,
    level: str = DEFAULT_LEVEL,
    resumed_from: str | None = None,
) -> float:
    """Every rank: `write(staging)` its shards and its random state; rank 0 then publishes
    (pruning never deletes `resumed_from`, the checkpoint the run resumed from).

    `write` may return a `finish_later(publish)` function instead of None: its writes go on in the
    background (an asynchronous save), and it runs `publish` on every rank once every rank's
    writes are done. Returns the seconds training was held up (rank 0's figure counts)."""
    import time

    import torch

    rank = torch.distributed.get_rank()
    started = time.perf_counter()
    if rank == 0:
        (prepare(root, step) / "rng").mkdir()
    torch.distributed.barrier()
    staging = partial_dir(root, step)
    with PeakMemory() as held, _without_zip_crc():
        finish_later = write(staging)
        torch.save(rng_state, staging / "rng" / f"rank_{rank:05d}.pt")
    finish = partial(
        _publish_collectively, root, step, keep_last, fault, trainer_state, started, level, held.extra, resumed_from
    )
    if finish_later is None:
        finish()
    else:
        finish_later(finish)
    return time.perf_counter() - started


def _publish_collectively(
    root: Path,
    step: int,
    keep_last: int,
    fault,
    trainer_state: dict,
    started: float,
    level: str,
    held: int = 0,
    resumed_from: str | None = None,
) -> None:
    """(every rank, after every rank's writes) Every rank checksums and fsyncs its share of the
    files (`share`: in parallel, not rank 0 alone), rank 0 merges the lists into the manifest, with
    the host memory each rank's write held (`held`), and publishes. Fault injection: rank 0 dies
    before publishing, or damages the published checkpoint."""
    import time

    import torch

    from toolkit.train.faults import _exit, corrupt, first_attempt

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    staging = partial_dir(root, step)
    torch.distributed.barrier()
    if rank == 0:
        if fault.crash_in_save_at_step == step and first_attempt():
            print(f"fault injection: rank 0 dies while saving step {step}", file=sys.stderr, flush=True)
            _exit(1)
        (staging / "trainer_state.json").write_text(json.dumps(trainer_state))
    torch.distributed.barrier()
    written = time.perf_counter()
    sizes = {str(p.relative_to(staging)): p.stat().st_size for p in _files(staging)}
    names = share(sizes, rank, world)
    with ThreadPoolExecutor(max(1, min(len(names), os.cpu_count() or 1, 4))) as pool:  # hashlib frees the GIL
        mine = dict(zip(names, pool.map(lambda name: file_entry(staging / name, level, sync=True), names)))
    everyone = [None] * world if rank == 0 else None
    torch.distributed.gather_object((mine, held), everyone, dst=0)
    if rank == 0:
        files = {name: entry for entries, _ in everyone for name, entry in entries.items()}
        seconds = {"write_seconds": written - started, "checksum_seconds": time.perf_counter() - written}
        memory = {"write_peak_extra_bytes": [extra for _, extra in everyone]}  # per rank
        extra = {**seconds, **memory, "verify": level}
        published = publish(root, step, keep_last, extra, files=files, resumed_from=resumed_from)
        print(
            f"saved checkpoint {published} ({time.perf_counter() - started:.1f} s; {level} checksums on {world} "
            f"rank(s) {seconds['checksum_seconds']:.2f} s)",
            flush=True,
        )
        if fault.corrupt_checkpoint_at_step == step and first_attempt():
            corrupt(published)
    torch.distributed.barrier()


@contextmanager
def _without_zip_crc():
    """torch.save without the CRC-32 its zip container computes over every record (1.2 s of CPU
    per GB, measured; torch.serialization.set_crc32_options): the manifest's checksums already
    cover every file, and torch.load reads the files either way. An asynchronous save's writer
    process, forked inside, inherits the setting."""
    import torch

    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(True)


class PeakMemory:
    """The most resident host memory this process held above where it started, over a `with`
    block (`extra`, bytes): sampled every 2 ms by a thread, as a save's clones, gathers and write
    buffers come and go faster than a per-step probe sees."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s, self.extra = interval_s, 0

    def __enter__(self) -> "PeakMemory":
        import threading

        import psutil

        self._process, self._done = psutil.Process(), threading.Event()
        self._start = self._peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(self.interval_s):
            self._peak = max(self._peak, self._process.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self._peak = max(self._peak, self._process.memory_info().rss)
        self.extra = self._peak - self._start


def verify_collectively(directory: Path, level: str = DEFAULT_LEVEL) -> str | None:
    """(every rank) Each rank verifies its share of the checkpoint's files, several at once
    (hashlib frees the GIL); the first problem any rank found (the same answer on every rank)."""
    import torch

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    listed, problem = listed_files(directory)
    if problem is None and level == "size":
        problem = _unlisted(directory, listed)
    if problem is None:
        mine = share({n: e["bytes"] for n, e in listed.items()}, rank, world)
        with ThreadPoolExecutor(max(1, min(len(mine), os.cpu_count() or 1, 4))) as pool:
            found = pool.map(lambda name: _verify_listed(directory, listed, level, [name]), mine)
            problem = next((p for p in found if p), None)
    problems = [None] * world
    torch.distributed.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


def _verify_everywhere(directory: Path, level: str) -> str | None:
    """(every rank) Sizes of all files first (nothing is hashed in a truncated checkpoint), then
    each rank's share of the checksums at `level`: the first problem, the same on every rank."""
    problem = verify_collectively(directory, "size")
    if problem is None and level != "size":
        problem = verify_collectively(directory, level)
    return problem


def load_collectively(root: Path, level: str, load: Callable[[Path], T]) -> tuple[Path | None, T | None, list[dict]]:
    """(every rank) The newest good checkpoint under `root`, loaded by `load`: (it or None, what
    `load` returned, the checkpoints passed over). Each candidate is verified before anything
    reads it: the sizes of all its files (missing, truncated), then their checksums (`level`),
    each rank its share; only a candidate that passes is loaded. The ones passed over are set
    aside (`.step_N.rejected`, files kept) once a good one is found: out of the resumable ones and
    of pruning's count. Rank 0 lists the candidates for everyone."""
    import torch

    rank0 = torch.distributed.get_rank() == 0
    listing = [[str(c) for c in _candidates(root)] if rank0 else None]
    torch.distributed.broadcast_object_list(listing, src=0)
    unusable = []
    for candidate in map(Path, listing[0]):
        problem = _verify_everywhere(candidate, level)
        if problem is None:
            loaded = _load_everywhere(candidate, load)
            if rank0:
                _set_aside_rejected(root, unusable)
            return candidate, loaded, unusable
        if rank0:
            print(f"checkpoint {candidate} is not usable: {problem}; trying an older one", file=sys.stderr, flush=True)
        unusable.append({"checkpoint": candidate.name, "problem": problem})
    refuse_to_start_over(root, unusable)
    return None, None, unusable


def _set_aside_rejected(root: Path, unusable: list[dict]) -> None:
    """(rank 0, after the resume found a good checkpoint) The newer ones it passed over, renamed
    out of `step_*`: the run saves those steps again, and pruning counts only good checkpoints."""
    for rejected in unusable:
        kept = retention.set_aside(root / rejected["checkpoint"], "rejected")
        rejected["set_aside_as"] = kept.name
        print(f"checkpoint {rejected['checkpoint']} set aside as {kept} (its files kept)", file=sys.stderr, flush=True)
    if unusable:
        fsync_path(root)


def _load_everywhere(candidate: Path, load: Callable[[Path], T]) -> T:
    """(every rank) `load` a verified candidate; a rank whose load fails raises its error, and the
    others say so instead of waiting for it."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    loaded, failure = None, None
    try:
        loaded = load(candidate)
    except ResumeError:  # refused from its recorded layout, before reading it: the same on every rank
        raise
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        failure = error
    failed = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(failed, failure is not None)
    if failure is not None:
        raise failure
    if any(failed):
        raise ResumeError(f"another rank failed loading {candidate}: see its error above")
    return loaded


def trainer_state(directory: Path) -> dict:
    """The step, scheduler and layout a checkpoint was saved with."""
    return json.loads((directory / "trainer_state.json").read_text())


def saved_rng_state(directory: Path, state: dict, world_size: int):
    """This rank's saved random state, when the checkpoint (its `trainer_state`) was written by
    as many ranks."""
    import torch

    path = directory / "rng" / f"rank_{torch.distributed.get_rank():05d}.pt"
    if state["layout"]["world"] != world_size or not path.exists():
        return None  # another layout: its random streams do not map onto these ranks
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:  # weights_only met something else than tensors and numbers
        raise ResumeError(
            f"{path} holds objects that are not a random state parakit writes, and is not loaded "
            f"({str(error).splitlines()[-1][:200]}). Fix: resume from a checkpoint this run's parakit wrote; a "
            "checkpoint from elsewhere is code: load only one you trust"
        ) from None
