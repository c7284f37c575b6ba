"""A checkpoint's manifest at each checkpoint.verify level, and how its files are shared out among
the ranks that checksum them in parallel (the multi-rank saves and resumes of
tests/test_faults_*.py run the collective side; scripts/bench_checkpoint.py measures it)."""

import random

import pytest

from toolkit.train import checkpoint as ckpt
from toolkit.train.faults import corrupt


def test_every_file_goes_to_exactly_one_rank_and_the_bytes_are_balanced():
    sizes = {f"f{i}": random.Random(i).randint(1, 1000) for i in range(37)}
    for world in (1, 2, 3, 8):
        shares = [ckpt.share(sizes, rank, world) for rank in range(world)]
        assert sorted(name for s in shares for name in s) == sorted(sizes)  # each file once
        loads = [sum(sizes[n] for n in s) for s in shares]
        assert max(loads) - min(loads) <= max(sizes.values()), loads  # greedy: within one file
        assert shares == [ckpt.share(dict(reversed(sizes.items())), r, world) for r in range(world)]  # any order


def _published(tmp_path, level: str):
    root = tmp_path / level
    staging = ckpt.prepare(root, 1)
    for i, size in enumerate((3000, 1000, 20)):
        (staging / f"shard_{i}.bin").write_bytes(random.Random(i).randbytes(size))
    return ckpt.publish(root, 1, keep_last=1, level=level)


@pytest.mark.parametrize("level", ["xxh3", "sha256", "crc32", "size"])
def test_each_level_records_and_checks_what_it_says(tmp_path, level):
    directory = _published(tmp_path, level)
    entries, _ = ckpt.listed_files(directory)
    assert all(set(e) == ({"bytes"} | ({level} - {"size"})) for e in entries.values()), entries
    assert ckpt.verify(directory, level) is None
    corrupt(directory)  # bytes flipped in place in the largest file: its size unchanged
    flipped = ckpt.verify(directory, level)
    if level == "size":
        assert flipped is None  # what the cheapest level gives up
    else:
        assert flipped == f"shard_0.bin fails its {level} checksum"
    assert ckpt.verify(directory, "size") is None  # a resume asking for sizes only reads nothing more
    with open(directory / "shard_1.bin", "r+b") as f:
        f.truncate(10)
    truncated = "shard_1.bin has 10 bytes, the manifest says 1000"
    assert ckpt.verify(directory, "size") == ckpt.verify(directory, level, names=["shard_1.bin"]) == truncated
    assert ckpt.verify(directory, level, names=["shard_2.bin"]) is None  # a rank's share only


def test_a_checkpoint_is_checked_with_the_checksum_its_manifest_recorded(tmp_path):
    """A checkpoint saved under another checkpoint.verify (an older run's sha256 or crc32) still
    resumes under the default, checked by what its manifest recorded, and its damage is found."""
    for recorded in ("sha256", "crc32"):
        directory = _published(tmp_path / recorded, recorded)
        assert ckpt.verify(directory) is None
        corrupt(directory)
        assert ckpt.verify(directory) == f"shard_0.bin fails its {recorded} checksum"


def test_the_checksums_agree_with_their_libraries(tmp_path):
    """Blocks read into one reused buffer hash like the whole file at once (a block boundary or a
    stale buffer tail would change the digest)."""
    import hashlib
    import zlib

    import xxhash

    path = tmp_path / "blob"
    data = random.Random(0).randbytes((1 << 22) + 12345)  # a full block and a short one
    path.write_bytes(data)
    assert ckpt.CHECKSUMS["xxh3"](path) == xxhash.xxh3_128(data).hexdigest()
    assert ckpt.CHECKSUMS["sha256"](path) == hashlib.sha256(data).hexdigest()
    assert ckpt.CHECKSUMS["crc32"](path) == f"{zlib.crc32(data):08x}"


def test_a_step_saved_again_keeps_the_checkpoint_it_replaces(tmp_path, capsys):
    """A run that resumed past a damaged step 1 saves step 1 again: the damaged directory is kept
    beside, renamed out of the resumable ones, never overwritten."""
    first = _published(tmp_path, "sha256")
    corrupt(first)
    damaged = (first / "shard_0.bin").read_bytes()
    again = _published(tmp_path, "sha256")
    assert again == first and ckpt.verify(again) is None
    kept = first.with_name(".step_00000001.replaced")
    assert (kept / "shard_0.bin").read_bytes() == damaged
    assert "kept as" in capsys.readouterr().err
    _published(tmp_path, "sha256")  # once more: another name, nothing lost
    assert kept.exists() and first.with_name(".step_00000001.replaced2").exists()
    assert [p.name for p in first.parent.glob("step_*")] == ["step_00000001"]


def test_a_run_never_starts_over_on_its_own(tmp_path):
    unusable = [{"checkpoint": "step_00000004", "problem": "shard_0.bin fails its sha256 checksum"}]
    with pytest.raises(ckpt.ResumeError, match="step_00000004: shard_0.bin fails its sha256 checksum.*Fix: "):
        ckpt.refuse_to_start_over(tmp_path, unusable)
    ckpt.refuse_to_start_over(tmp_path / "none", [])  # nothing there yet: step 0
    ckpt.refuse_to_start_over(tmp_path / "none", None)
    _published(tmp_path, "size")  # tmp_path/size/step_00000001
    with pytest.raises(ckpt.ResumeError, match=r"checkpoint.resume=false, and .* \(step_00000001\).*Fix: "):
        ckpt.refuse_to_start_over(tmp_path / "size", None)


@pytest.fixture
def one_rank(monkeypatch):
    """torch.distributed's collectives as a world of one rank sees them, in this process."""
    import torch

    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", lambda objects, src: None)
    monkeypatch.setattr(torch.distributed, "all_gather_object", lambda out, obj: out.__setitem__(0, obj))


def _steps(tmp_path, damaged_step: int | None = None):
    """Published steps 1 and 2 of one run (large enough files to hash for a while); one damaged."""
    for step in (1, 2):
        staging = ckpt.prepare(tmp_path, step)
        for i in range(3):
            (staging / f"shard_{i}.bin").write_bytes(random.Random(step * 10 + i).randbytes((4 - i) << 20))
        published = ckpt.publish(tmp_path, step, keep_last=2)
        if step == damaged_step:
            corrupt(published)
    return tmp_path


def test_checksums_run_while_the_backend_loads_and_a_failure_passes_over_what_it_loaded(
    tmp_path, one_rank, monkeypatch
):
    """The load reads each file once with the hashing (both under way together); a newest step that
    fails its checksums after its load is passed over, and the older one loaded in its place."""
    import threading

    hashing, loading, verified_during_load = threading.Event(), threading.Event(), []
    verify_listed = ckpt._verify_listed

    def verify_when_the_load_runs(directory, listed, level, names=None):
        if level != "size":  # the size check comes first, before anything reads the files
            hashing.set()
            verified_during_load.append(loading.wait(timeout=10))  # not before a load starts
        return verify_listed(directory, listed, level, names)

    monkeypatch.setattr(ckpt, "_verify_listed", verify_when_the_load_runs)
    loads = []

    def load(candidate):
        loading.set()
        loads.append((candidate.name, hashing.wait(timeout=10)))  # nor after it ends
        hashing.clear()  # the next candidate's hashing sets it again
        return f"model of {candidate.name}"

    found, loaded, unusable = ckpt.load_collectively(_steps(tmp_path, damaged_step=2), "sha256", load)
    assert loads == [("step_00000002", True), ("step_00000001", True)]
    assert verified_during_load and all(verified_during_load)
    assert (found.name, loaded) == ("step_00000001", "model of step_00000001")
    assert unusable == [{"checkpoint": "step_00000002", "problem": "shard_0.bin fails its xxh3 checksum"}]


def test_a_load_that_fails_is_explained_by_the_checksums_or_raised(tmp_path, one_rank):
    """Damaged bytes can break the backend's load itself: passed over when its checksums fail; the
    load's own error when the checkpoint is sound. A truncated checkpoint is never loaded."""

    def load(candidate):
        if candidate.name == "step_00000002":
            raise RuntimeError("unpickling failed")
        return candidate.name

    root = _steps(tmp_path / "damaged", damaged_step=2)
    assert ckpt.load_collectively(root, "crc32", load)[1] == "step_00000001"
    with pytest.raises(RuntimeError, match="unpickling failed"):
        ckpt.load_collectively(_steps(tmp_path / "sound"), "sha256", load)
    with open(root / "step_00000002" / "shard_1.bin", "r+b") as f:
        f.truncate(10)
    loads = []
    found, _, unusable = ckpt.load_collectively(root, "sha256", lambda c: loads.append(c.name))
    assert loads == ["step_00000001"] and "shard_1.bin has 10 bytes" in unusable[0]["problem"]


def test_a_deepspeed_load_maps_its_files_and_leaves_torch_load_as_it_was():
    """engine.load_checkpoint's torch.load calls map the files inside the block only (the resume
    tests in test_faults_deepspeed.py show the mapped load resumes exactly)."""
    from torch.utils.serialization import config

    from toolkit.train.deepspeed_checkpoint import _mapped_loads

    before = config.load.mmap
    with _mapped_loads():
        assert config.load.mmap is True
    assert config.load.mmap == before
    try:
        with _mapped_loads():
            raise KeyError("a failed load")
    except KeyError:
        pass
    assert config.load.mmap == before
