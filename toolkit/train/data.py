"""Training data: the corpus through megatron-core's GPTDataset, or synthetic tokens, read in
the same global order by every layout.

Step s of a run consumes samples [s*B, (s+1)*B) of the dataset (B the global batch); micro-batch
j of data-parallel rank r takes the mb samples starting at s*B + j*mb*dp + r*mb, the order of
Megatron-LM's MegatronPretrainingSampler. So a run's global batches are the same at every
layout, which the parity tests rely on, and a resumed run can continue at any step.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from toolkit.config.schema import Config
from toolkit.formats.manifest import parse_blend, read_manifest
from toolkit.plan.layout import Layout


class _Vocabulary:
    """What GPTDataset asks of a tokenizer: the vocabulary size and the end-of-document id (from
    the dataset's manifest; the bundled GPT-2 BPE's for a prefix without one)."""

    def __init__(self, name: str, vocab_size: int, eod: int):
        self.vocab_size, self.eod, self.pad = vocab_size, eod, eod
        self.unique_identifiers = {"class": name, "vocab_size": vocab_size, "eod": eod}


_GPT2 = ("gpt2-bpe", 50257, 50256)


class SyntheticTokens:
    """Random tokens, the same for a sample index on every rank and every run."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed

    def __len__(self) -> int:
        return 2**62

    def batch(self, first: int, count: int) -> dict:
        """Samples [first, first + count) stacked: one array filled in place, no per-sample tensors."""
        text = np.empty((count, self.seq_length + 1), dtype=np.int64)
        for row, index in enumerate(range(first, first + count)):
            text[row] = np.random.default_rng([self.seed, index]).integers(0, self.vocab_size, self.seq_length + 1)
        text = torch.from_numpy(text)
        return {
            "tokens": text[:, :-1].contiguous(),
            "labels": text[:, 1:].contiguous(),
            "loss_mask": torch.ones(count, self.seq_length),
            "position_ids": torch.arange(self.seq_length).repeat(count, 1),
        }

    def __getitem__(self, index: int) -> dict:
        return {key: value[0] for key, value in self.batch(index, 1).items()}


@dataclass
class Datasets:
    train: object
    valid: object | None  # None: no evaluation (train.eval_interval=null)


def index_cache(directory: Path) -> str:
    """Where megatron-core keeps the sample indices: `directory`, when every rank sees the files
    rank 0 writes there (megatron-core builds them on global rank 0 and the others read them); ""
    (every rank builds them in memory) when some cannot, as on nodes without a shared filesystem.
    A collective: rank 0 writes a probe file, every rank looks for it."""
    rank = torch.distributed.get_rank()
    directory.mkdir(parents=True, exist_ok=True)
    probe = [None]
    if rank == 0:
        fd, path = tempfile.mkstemp(dir=directory, prefix=".shared-")
        os.close(fd)
        probe[0] = os.path.basename(path)
    torch.distributed.broadcast_object_list(probe, src=0)
    seen = [None] * torch.distributed.get_world_size()  # objects, not tensors: gloo and NCCL alike
    torch.distributed.all_gather_object(seen, (directory / probe[0]).exists())
    if rank == 0:
        (directory / probe[0]).unlink()
    if all(seen):
        return str(directory)
    if rank == 0:
        print(
            f"data: {directory} is not shared by every node (rank 0's files are missing on some): each rank "
            "builds the sample indices in memory (PARAKIT_CACHE on a shared filesystem builds them once)",
            flush=True,
        )
    return ""


def _corpus_datasets(cfg: Config, train_samples: int, valid_samples: int | None) -> Datasets:
    """GPTDataset over data.path (a prefix or a weighted blend) or the bundled corpus, split by
    data.split (rank 0 builds the sample indices, the others read them: index_cache)."""
    from toolkit.compat import import_shims
    from toolkit.data.corpus import CACHE, prepare_corpus

    import_shims()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if not cfg.data.path and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        prepare_corpus()  # once per node (its cache may be its own), the others wait and read it
    torch.distributed.barrier()
    prefixes, weights = parse_blend(cfg.data.path) if cfg.data.path else ([str(prepare_corpus(progress=False))], None)
    manifest = read_manifest(prefixes[0])  # the validator checked that every part agrees
    vocabulary = _Vocabulary(manifest.tokenizer, manifest.vocab_size, manifest.eod) if manifest else _Vocabulary(*_GPT2)
    config = GPTDatasetConfig(
        random_seed=cfg.train.seed,
        sequence_length=cfg.model.seq_length,
        blend=(prefixes, weights),
        split=cfg.data.split,
        tokenizer=vocabulary,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=index_cache(CACHE / "data" / "index"),
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [train_samples, valid_samples or 0, 0], lambda: True, config)
    train, valid, _ = builder.build()
    return Datasets(train, valid if valid_samples else None)


def build_datasets(cfg: Config, layout: Layout) -> Datasets:
    """The training samples of the run, and the validation samples one evaluation reads."""
    valid_samples = cfg.train.eval_iters * layout.global_batch if cfg.train.eval_interval else None
    if cfg.data.name == "synthetic":
        valid = SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed + 1)
        return Datasets(SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed), valid)
    return _corpus_datasets(cfg, layout.steps * layout.global_batch, valid_samples)


def eval_batches(dataset, layout: Layout, dp_rank: int):
    """The micro-batches of one evaluation: the first train.eval_iters global batches of the
    validation samples, in the training order (the same ones at every evaluation)."""
    return micro_batches(dataset, layout, dp_rank, start_step=0)


_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class _StepSampler(torch.utils.data.Sampler):
    """A step's micro-batches of one data-parallel rank, as index ranges, step after step:
    micro-batch j of rank r at step s holds samples [s*B + j*mb*dp + r*mb, ... + mb)."""

    def __init__(self, layout: Layout, dp_rank: int, start_step: int):
        self.layout, self.dp_rank, self.start_step = layout, dp_rank, start_step

    def __iter__(self):
        lay, step = self.layout, self.start_step
        while True:
            base = step * lay.global_batch + self.dp_rank * lay.micro_batch
            firsts = [base + j * lay.micro_batch * lay.dp for j in range(lay.grad_accum)]
            yield [range(first, first + lay.micro_batch) for first in firsts]
            step += 1


class _MicroBatches(torch.utils.data.Dataset):
    """Stacks the samples of each index range into one micro-batch (in a loader worker when there
    are workers). A dataset with a `batch` getter (SyntheticTokens) makes a range in one call."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getitems__(self, ranges: list[range]) -> list[dict]:
        batch = getattr(self.dataset, "batch", None)
        if batch is not None:
            return [batch(r.start, len(r)) for r in ranges]
        return [
            {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in _KEYS}
            for samples in ([self.dataset[i] for i in r] for r in ranges)
        ]


def _as_is(batch):
    return batch


def micro_batches(dataset, layout: Layout, dp_rank: int, start_step: int = 0, device=None, workers: int | None = None):
    """This data-parallel rank's micro-batches, step after step, as stacked tensors on `device`
    (default: the current CUDA device when there is one, as Megatron-LM's get_batch does; else
    the CPU, no copy), in the order of Megatron-LM's MegatronPretrainingSampler.

    A torch DataLoader makes them: with `workers` (default: layout.loader_workers) loader processes
    (each keeping two steps ready)
    and pinned host memory on a GPU, nothing of the sample making is left inside the step; with
    none, a step's micro-batches are made together when the step asks for its first, one burst
    of data work per step rather than one between forward/backward passes, each of which finds
    the caches cold (measured on CPU: 0.27 ms per SyntheticTokens batch of 2 there, 0.07 ms warm).
    The order is the sampler's, the same with any number of workers."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    workers = layout.loader_workers if workers is None else workers
    loader = torch.utils.data.DataLoader(
        _MicroBatches(dataset),
        batch_sampler=_StepSampler(layout, dp_rank, start_step),
        collate_fn=_as_is,
        num_workers=workers,
        pin_memory=device is not None and device.type == "cuda",
        prefetch_factor=2 if workers else None,
        # Its own generator: a DataLoader iterator draws a worker base seed, which from the global
        # generator would shift the dropout masks after every resume or evaluation.
        generator=torch.Generator().manual_seed(0),
    )
    for step in loader:
        for micro in step:
            yield {key: value.to(device, non_blocking=True) for key, value in micro.items()} if device else micro
