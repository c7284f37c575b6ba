"""A checkpoint's manifest at each checkpoint.verify level, and how its files are shared out among
the ranks that checksum them in parallel (the multi-rank saves and resumes of
tests/test_faults_*.py run the collective side; scripts/bench_checkpoint.py measures it)."""

import json
import random
import shutil

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
    """A step published again (a conversion into another format) keeps the earlier directory beside,
    renamed out of the resumable ones, never overwritten; the copies set aside are bounded by
    keep_last (here 1: the newest)."""
    first = _published(tmp_path, "sha256")
    corrupt(first)
    damaged = (first / "shard_0.bin").read_bytes()
    again = _published(tmp_path, "sha256")
    assert again == first and ckpt.verify(again) is None
    kept = first.with_name(".step_00000001.replaced")
    assert (kept / "shard_0.bin").read_bytes() == damaged
    assert "kept as" in capsys.readouterr().err
    _published(tmp_path, "sha256")  # once more: another name, and the oldest copy goes
    assert not kept.exists() and first.with_name(".step_00000001.replaced2").exists()
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


def test_nothing_is_read_before_its_checksum_is_verified(tmp_path, one_rank, monkeypatch):
    """The backend's load starts only once every file of the candidate has passed its checksum; a
    newest step that fails is never loaded, and the older one is."""
    verified = []
    verify_listed = ckpt._verify_listed

    def recording(directory, listed, level, names=None):
        problem = verify_listed(directory, listed, level, names)
        verified.extend((directory.name, level, name) for name in (listed if names is None else names))
        return problem

    monkeypatch.setattr(ckpt, "_verify_listed", recording)
    loads = []

    def load(candidate):
        checked = {name for directory, level, name in verified if directory == candidate.name and level == "sha256"}
        loads.append((candidate.name, checked == set(ckpt.listed_files(candidate)[0])))
        return f"model of {candidate.name}"

    found, loaded, unusable = ckpt.load_collectively(_steps(tmp_path, damaged_step=2), "sha256", load)
    assert loads == [("step_00000001", True)]  # step 2 never loaded; step 1 only once all of it verified
    assert (found.name, loaded) == ("step_00000001", "model of step_00000001")
    assert unusable[0]["checkpoint"] == "step_00000002"
    assert unusable[0]["problem"] == "shard_0.bin fails its xxh3 checksum"


def test_a_load_that_fails_is_raised_and_a_truncated_checkpoint_never_loaded(tmp_path, one_rank):
    """A sound checkpoint whose load fails raises the load's own error; a truncated or damaged one is
    never handed to the load."""

    def load(candidate):
        if candidate.name == "step_00000002":
            raise RuntimeError("unpickling failed")
        return candidate.name

    with pytest.raises(RuntimeError, match="unpickling failed"):
        ckpt.load_collectively(_steps(tmp_path / "sound"), "sha256", load)
    root = _steps(tmp_path / "damaged", damaged_step=2)
    assert ckpt.load_collectively(root, "crc32", load)[1] == "step_00000001"
    root = _steps(tmp_path / "truncated")
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


# ------------------------------------------------------------------ what pruning keeps
def _publish_step(root, step: int, keep_last: int, resumed_from=None, size: int = 1000):
    """A published checkpoint of a shard and a random state, as a one-rank run writes them."""
    import torch

    staging = ckpt.prepare(root, step)
    (staging / "shard.bin").write_bytes(random.Random(step).randbytes(size))
    (staging / "rng").mkdir()
    torch.save(ckpt.host_rng_state(), staging / "rng" / "rank_00000.pt")
    return ckpt.publish(root, step, keep_last, resumed_from=resumed_from)


def _names(root, pattern="step_*"):
    return sorted(p.name for p in root.glob(pattern))


def test_a_resume_past_a_damaged_checkpoint_keeps_the_one_it_resumed(tmp_path, one_rank, capsys):
    """The issue's reproduction: step 2 good, step 4 damaged, keep_last=1. The resume sets step 4
    aside; saving step 3 keeps step 2 (resumed from) and step 3 (just published), and `latest`
    names a checkpoint that exists. Before, pruning by name kept only the damaged step 4."""
    root = tmp_path / "checkpoints"
    _publish_step(root, 2, keep_last=2)
    corrupt(_publish_step(root, 4, keep_last=2))
    found, _, unusable = ckpt.load_collectively(root, "xxh3", lambda candidate: candidate.name)
    assert found.name == "step_00000002" and unusable[0]["set_aside_as"] == ".step_00000004.rejected"
    assert "set aside as" in capsys.readouterr().err
    assert _names(root) == ["step_00000002"] and (root / ".step_00000004.rejected" / "shard.bin").exists()
    _publish_step(root, 3, keep_last=1, resumed_from=str(found))
    assert _names(root) == ["step_00000002", "step_00000003"]
    assert (root / ckpt.LATEST).read_text().strip() == "step_00000003"
    _publish_step(root, 4, keep_last=1, resumed_from=str(found))  # the rejected one's step, saved again
    assert _names(root) == ["step_00000002", "step_00000004"] and ckpt.find_resumable(root).name == "step_00000004"
    assert ckpt.verify(root / "step_00000004") is None


def test_pruning_counts_publication_order_not_names(tmp_path):
    """A run that resumed an older step publishes lower step numbers after higher ones: the
    checkpoints published last are kept, whatever their names."""
    root = tmp_path / "checkpoints"
    _publish_step(root, 9, keep_last=2)
    _publish_step(root, 3, keep_last=2)
    _publish_step(root, 4, keep_last=2)
    assert _names(root) == ["step_00000003", "step_00000004"]


def test_leftovers_are_bounded_and_a_prune_that_fails_is_said(tmp_path, capsys):
    """Staging folders of saves that never finished go at the next save; universal conversions go
    with their checkpoint; a step that is a symbolic link is not followed, and said."""
    root = tmp_path / "checkpoints"
    _publish_step(root, 1, keep_last=1)
    (root / ".step_00000007.partial").mkdir()  # a save killed mid-write
    (root / ".universal" / "step_00000001").mkdir(parents=True)
    (root / ".universal" / ".step_00000001.partial").mkdir()
    _publish_step(root, 2, keep_last=1)
    assert _names(root, ".step_*") == [] and _names(root) == ["step_00000002"]
    assert not any((root / ".universal").iterdir())
    elsewhere = tmp_path / "elsewhere"
    shutil.move(root / "step_00000002", elsewhere)
    (root / "step_00000002").symlink_to(elsewhere)
    _publish_step(root, 3, keep_last=1)
    said = capsys.readouterr().err
    assert f"warning [prune] could not remove {root / 'step_00000002'}" in said and "symbolic link" in said
    assert (elsewhere / "manifest.json").exists() and (root / "step_00000002").is_symlink()


# ------------------------------------------------------------------ loading runs no code
class _Runs:
    """An object whose unpickling creates a file: what a crafted checkpoint would make run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _crafted_rng(directory, marker, update_manifest: bool):
    import torch

    path = directory / "rng" / "rank_00000.pt"
    torch.save({"python": _Runs(marker)}, path)
    if update_manifest:  # the forger rewrites the manifest too: its checksum then passes
        manifest = json.loads((directory / ckpt.MANIFEST).read_text())
        manifest["files"]["rng/rank_00000.pt"] = ckpt.file_entry(path)
        (directory / ckpt.MANIFEST).write_text(json.dumps(manifest))


def test_a_crafted_random_state_runs_no_code(tmp_path, one_rank):
    """Manifest untouched: the checksum fails before anything is unpickled, the checkpoint is passed
    over. Manifest updated: the checksum passes, and the weights-only load refuses the object."""
    marker = tmp_path / "ran"
    root = tmp_path / "checkpoints"
    _publish_step(root, 1, keep_last=2)
    _crafted_rng(_publish_step(root, 2, keep_last=2), marker, update_manifest=False)
    loaded = []

    def load(candidate):
        loaded.append(candidate.name)
        return ckpt.saved_rng_state(candidate, {"layout": {"world": 1}}, 1)

    found, _, unusable = ckpt.load_collectively(root, "xxh3", load)
    assert found.name == "step_00000001" and loaded == ["step_00000001"] and not marker.exists()
    assert unusable[0]["problem"].startswith("rng/rank_00000.pt ")  # its size or its checksum
    forged = _publish_step(root, 3, keep_last=3)
    _crafted_rng(forged, marker, update_manifest=True)
    with pytest.raises(ckpt.ResumeError, match="not a random state parakit writes.*Fix: "):
        ckpt.load_collectively(root, "xxh3", load)
    assert not marker.exists()
    (root / "step_00000001" / "rng" / "extra.pt").write_bytes(b"x")  # a file no save wrote
    assert ckpt.verify(root / "step_00000001") == "rng/extra.pt is not in its manifest (added after the save)"


def test_random_states_round_trip_through_the_weights_only_load(tmp_path, one_rank):
    """What the trainer saves (python, numpy, torch generators) loads with weights_only=True and
    restores every generator; a state saved before numpy's keys went in as a tensor loads too."""
    import random as python_random

    import numpy as np
    import torch

    directory = tmp_path / "step"
    (directory / "rng").mkdir(parents=True)
    ckpt.seed_host_rngs(3)
    torch.save(ckpt.host_rng_state(), directory / "rng" / "rank_00000.pt")
    expected = (python_random.random(), np.random.rand(), torch.rand(1).item())
    ckpt.seed_host_rngs(4)
    ckpt.set_host_rng_state(ckpt.saved_rng_state(directory, {"layout": {"world": 1}}, 1))
    assert (python_random.random(), np.random.rand(), torch.rand(1).item()) == expected
    older = {**ckpt.host_rng_state(), "numpy": np.random.get_state()}  # an ndarray, as before
    torch.save(older, directory / "rng" / "rank_00000.pt")
    assert (
        ckpt.saved_rng_state(directory, {"layout": {"world": 1}}, 1)["numpy"][1].tolist() == older["numpy"][1].tolist()
    )


def test_a_save_out_of_space_is_one_error_naming_the_folder(tmp_path, monkeypatch):
    """ENOSPC and EDQUOT, raised or wrapped (a cause, DCP's per-rank failures), become one
    CheckpointSpaceError with the staging folder removed; other errors go through as they were.
    (tests/test_checkpoint_durability.py fills a real filesystem.)"""
    import errno

    from toolkit.train import checkpoint_space as space

    root = tmp_path / "checkpoints"
    _publish_step(root, 1, keep_last=1, size=5000)
    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("writer failed")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    dcp_like = RuntimeError("CheckpointException ranks:dict_keys([1])")
    dcp_like.failures = {1: (full, None)}
    for error in (full, wrapped, dcp_like):
        (root / ".step_00000002.partial").mkdir()
        with pytest.raises(space.CheckpointSpaceError, match=f"checkpoint.dir {root} ran out of space.*Fix: "):
            with space.space_named(root, estimate=1e6):
                raise error
        assert not (root / ".step_00000002.partial").exists()
    with pytest.raises(ValueError, match="not about space"), space.space_named(root, estimate=1e6):
        raise ValueError("not about space")
    assert space.needed_bytes(root, 1e6)[0] == sum(
        e["bytes"] for e in ckpt.listed_files(root / "step_00000001")[0].values()
    )
    assert space.needed_bytes(tmp_path / "none", 1e6) == (1000000, "the planner's estimate")


def test_a_save_killed_before_latest_is_resumed_not_the_one_before(tmp_path, one_rank):
    """Killed between the publishing rename and `latest`: the checkpoint is whole and published
    last, so it is the one resumed; `latest` still names the one before."""
    root = tmp_path / "checkpoints"
    _publish_step(root, 2, keep_last=3)
    _publish_step(root, 4, keep_last=3)
    (root / ckpt.LATEST).write_text("step_00000002\n")  # as the killed save left it
    found, _, _ = ckpt.load_collectively(root, "xxh3", lambda candidate: None)
    assert found.name == "step_00000004"
