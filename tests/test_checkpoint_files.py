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


@pytest.mark.parametrize("level", ["sha256", "crc32", "size"])
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
