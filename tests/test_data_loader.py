"""The DataLoader behind micro_batches: the global sample order of Megatron-LM's
MegatronPretrainingSampler with any number of loader workers, and from any step (resume)."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import textwrap

import torch

from toolkit.plan.layout import resolve
from toolkit.train.data import SyntheticTokens, micro_batches


class Numbered:
    """Sample i is the token i: which samples a micro-batch holds can be read off it."""

    def __len__(self):
        return 10**6

    def __getitem__(self, index):
        tokens = torch.full((4,), index)
        return {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(4), "position_ids": torch.arange(4)}


def taken(dataset, layout, rank, start, workers, count):
    return list(itertools.islice(micro_batches(dataset, layout, rank, start_step=start, workers=workers), count))


def test_order_is_megatron_samplers_with_any_workers_and_from_any_step(compose):
    cfg = compose("cluster.gpus_per_node=2", "train.global_batch=12", "train.micro_batch=2")
    layout = resolve(cfg)
    assert (layout.dp, layout.grad_accum) == (2, 3)
    for rank in (0, 1):
        samples = [b["tokens"][:, 0].tolist() for b in taken(Numbered(), layout, rank, 2, 2, 6)]
        # step s, micro j, rank r: samples s*12 + j*4 + r*2 + [0, 1]
        assert samples == [[s * 12 + j * 4 + rank * 2 + i for i in range(2)] for s in (2, 3) for j in range(3)]
    synthetic = SyntheticTokens(1000, 8, seed=5)
    for dataset in (Numbered(), synthetic):
        alone = taken(dataset, layout, 1, 0, 0, 15)
        with_workers = taken(dataset, layout, 1, 0, 2, 15)
        resumed = taken(dataset, layout, 1, 2, 2, 9)  # steps 2-4 of the same run
        for a, b in zip(alone, with_workers):
            assert all(torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(alone[6:], resumed):
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_default_workers_follow_the_device(compose):
    assert resolve(compose()).loader_workers == 0  # CPU: the ranks already use every core
    assert resolve(compose("cluster=8xh100", "model=llama3_8b", "parallel.tp=8")).loader_workers == 2
    assert resolve(compose("data.num_workers=6")).loader_workers == 6


def test_data_bench_compares_the_loader_with_the_planned_gpus(capsys):
    """Measured supply against the planner's demand: a CPU rank keeps up with its loader (exit 0);
    GPUs 10^9 times faster than a CPU would be starved (exit 3), and it says so."""
    from toolkit.cli import main

    assert main(["data", "bench", "cluster.gpus_per_node=1", "data=synthetic", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    supplied, consumed = (float(x.replace(",", "")) for x in re.findall(r"([\d,.]+) samples/s", out)[:2])
    assert "keeps up" in out and supplied > consumed > 0
    fast = ["cluster.peak_tflops_fp32=1e9", "cluster.hbm_bandwidth_gbs=1e12", "cluster.stack={}"]
    fast += ["cluster.fresh_memory_gbs=null"]  # nor its stack costs or fresh pages
    assert main(["data", "bench", "data=synthetic", "cluster.gpus_per_node=1", *fast, "--steps", "5"]) == 3
    assert "would starve the GPUs" in capsys.readouterr().out


def test_making_batches_leaves_the_global_random_state_alone(compose):
    """Dropout masks come from the global generator: starting a loader (at a resume, for an
    evaluation) must not draw from it, or a resumed run's masks differ from the uninterrupted one's."""
    layout = resolve(compose())
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    for workers in (0, 2):
        next(micro_batches(Numbered(), layout, 0, workers=workers))
    assert torch.equal(torch.rand(3), expected)


def test_multi_node_corpus_preparers_sharing_a_cache_write_it_once(tmp_path, monkeypatch):
    """Each node's local rank 0 prepares the bundled corpus (toolkit.train.data); nodes sharing a
    filesystem share the cache: four concurrent preparers (threads here, flock excludes them as it
    excludes processes on other nodes) write it once, and every one returns the published prefix."""
    import threading
    import time

    from toolkit.data import corpus
    from toolkit.formats.manifest import manifest_path

    monkeypatch.setattr(corpus, "CACHE", tmp_path)
    writes = []

    def slow_write(prefix, progress):  # the tokenization, made slow enough for the others to arrive
        writes.append(threading.get_ident())
        time.sleep(0.3)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        manifest_path(prefix).write_text("{}")

    monkeypatch.setattr(corpus, "_write_corpus", slow_write)
    prefixes = []
    workers = [threading.Thread(target=lambda: prefixes.append(corpus.prepare_corpus())) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(writes) == 1 and prefixes == [corpus.corpus_prefix()] * 4


_NODES_WITHOUT_SHARED_FILES = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import torch
    import torch.multiprocessing as mp

    def rank_main(rank, tmp):
        os.environ.update(LOCAL_RANK="0", RANK=str(rank), WORLD_SIZE="2")  # each rank its node's first
        store = torch.distributed.FileStore(f"{tmp}/store", 2)
        torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=2)
        from toolkit.config.store import compose_config
        from toolkit.plan.layout import resolve
        from toolkit.train import data

        cfg = compose_config(["data=corpus", "cluster.gpus_per_node=2", "train.steps=2", "train.eval_interval=null"])
        seen = {}
        check = data.index_cache
        for case, directory in (("shared", "index"), ("own", f"index-node{rank}")):
            data.index_cache = lambda _: seen.setdefault(case, check(Path(tmp) / directory))
            train = data.build_datasets(cfg, resolve(cfg)).train
            tokens = [None, None]
            torch.distributed.all_gather_object(tokens, [train[i]["tokens"].tolist() for i in range(4)])
            seen[case + " samples equal"] = tokens[0] == tokens[1]
            seen[case + " files"] = sorted(p.name for p in (Path(tmp) / directory).iterdir())
        Path(tmp, f"result-{rank}.json").write_text(json.dumps(seen))  # not stdout: the ranks' lines interleave
        # Leave without running gloo's and the FileStore's destructors: left to the interpreter's exit
        # (and even after destroy_process_group, under load) they can abort the rank ("terminate called
        # without an active exception", seen twice). Both ranks have written their results by the barrier.
        torch.distributed.barrier()
        sys.stdout.flush()
        os._exit(0)

    if __name__ == "__main__":
        mp.spawn(rank_main, args=(sys.argv[1],), nprocs=2)
""")


def test_multi_node_sample_indices_without_a_shared_filesystem(tmp_path):
    """megatron-core builds the sample indices on global rank 0 and the other ranks read its files:
    on nodes without a shared filesystem they are missing there. toolkit.train.data checks that
    every rank sees rank 0's files: in a shared directory they are cached once (and the probe file
    is gone again); in a directory of each node's own (two ranks given two) every rank builds them
    in memory and both read the same samples."""
    script = tmp_path / "nodes.py"
    script.write_text(_NODES_WITHOUT_SHARED_FILES)
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    for seen in ranks:
        assert seen["shared"] == str(tmp_path / "index") and seen["own"] == "", seen
        assert seen["shared samples equal"] and seen["own samples equal"], seen
        assert any(name.endswith("sample_index.npy") for name in seen["shared files"]), seen
        assert not [name for name in seen["shared files"] if name.startswith(".shared-")], seen
        assert seen["own files"] == [], seen  # nothing written to or expected from a node's own cache
    assert "not shared by every node" in result.stdout
