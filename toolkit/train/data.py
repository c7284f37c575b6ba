"""Training data: the corpus through megatron-core's GPTDataset, or synthetic tokens, read in
the same global order by every layout.

Step s of a run consumes samples [s*B, (s+1)*B) of the dataset (B the global batch); micro-batch
j of data-parallel rank r takes the mb samples starting at s*B + j*mb*dp + r*mb, the order of
Megatron-LM's MegatronPretrainingSampler. So a run's global batches are the same at every
layout, which the parity tests rely on, and a resumed run can continue at any step.
"""

from __future__ import annotations

import numpy as np
import torch

from toolkit.config.schema import Config
from toolkit.plan.layout import Layout


class _GPT2Vocabulary:
    """What GPTDataset asks of a tokenizer: the vocabulary size and the end-of-document id."""

    vocab_size, eod, pad = 50257, 50256, 50256
    unique_identifiers = {"class": "gpt2-bpe", "vocab_size": 50257}


class SyntheticTokens:
    """Random tokens, the same for a sample index on every rank and every run."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, index: int) -> dict:
        rng = np.random.default_rng([self.seed, index])
        text = torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_length + 1).astype(np.int64))
        return {
            "tokens": text[:-1],
            "labels": text[1:],
            "loss_mask": torch.ones(self.seq_length),
            "position_ids": torch.arange(self.seq_length),
        }


def corpus_dataset(cfg: Config, num_samples: int):
    """GPTDataset over the prepared corpus (rank 0 builds the sample index, the others read it)."""
    from toolkit.train import mcore_cpu
    from toolkit.train.corpus import CACHE, prepare_corpus

    mcore_cpu.import_shims()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if not cfg.data.path and torch.distributed.get_rank() == 0:
        prepare_corpus()  # once, on rank 0: the others wait and read the cached files
    torch.distributed.barrier()
    prefix = cfg.data.path or str(prepare_corpus(progress=False))
    config = GPTDatasetConfig(
        random_seed=cfg.train.seed,
        sequence_length=cfg.model.seq_length,
        blend=([prefix], None),
        split="100,0,0",
        tokenizer=_GPT2Vocabulary(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(CACHE / "data" / "index"),
    )
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, None, None], lambda: True, config).build()
    return train


def train_dataset(cfg: Config, layout: Layout):
    if cfg.data.name == "synthetic":
        return SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed)
    return corpus_dataset(cfg, layout.steps * layout.global_batch)


def micro_batches(dataset, layout: Layout, dp_rank: int, start_step: int = 0):
    """This data-parallel rank's micro-batches, step after step, as stacked tensors."""
    step = start_step
    while True:
        for micro in range(layout.grad_accum):
            first = step * layout.global_batch + micro * layout.micro_batch * layout.dp + dp_rank * layout.micro_batch
            samples = [dataset[first + i] for i in range(layout.micro_batch)]
            yield {
                key: torch.stack([torch.as_tensor(s[key]) for s in samples])
                for key in ("tokens", "labels", "loss_mask", "position_ids")
            }
        step += 1
