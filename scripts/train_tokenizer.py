"""Train a byte-level BPE tokenizer on text files with Hugging Face `tokenizers`, saved as a
transformers tokenizer directory that `parakit data prepare --tokenizer DIR` reads.

    python scripts/train_tokenizer.py FILE... --output DIR [--vocab-size 16000] [--reserved 0]

--reserved N puts N reserved special tokens (<|reserved_0|> ...) at the front of the vocabulary,
as Llama 3 keeps 256 for later use; the learned tokens follow them. With --reserved 60000 a
small corpus gives a vocabulary above 65,535 whose ordinary ids mostly exceed 65,535: what the
tests use to show that such ids survive preparation (a uint16 dataset would wrap them).
Inputs: plain text, or jsonl (the "text" field of each line).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterator

END_OF_TEXT = "<|endoftext|>"


def _texts(paths: list[Path]) -> Iterator[str]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            if path.suffix == ".jsonl":
                yield from (json.loads(line)["text"] for line in f if line.strip())
            else:
                yield f.read()


def train_tokenizer(paths: list[Path], output: Path, vocab_size: int = 16000, reserved: int = 0) -> int:
    """Train, save to `output`; the vocabulary size (reserved and special tokens included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [f"<|reserved_{i}|>" for i in range(reserved)] + [END_OF_TEXT]
    trainer = trainers.BpeTrainer(
        vocab_size=reserved + vocab_size,
        special_tokens=specials,  # ids 0..reserved: the learned tokens come after them
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_texts(paths), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT, model_max_length=10**9)
    wrapped.save_pretrained(str(output))
    return len(wrapped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--vocab-size", type=int, default=16000, help="learned tokens (bytes included)")
    parser.add_argument("--reserved", type=int, default=0, help="reserved special tokens before them")
    args = parser.parse_args()
    size = train_tokenizer(args.inputs, args.output, args.vocab_size, args.reserved)
    print(f"wrote {args.output}: {size:,} tokens")


if __name__ == "__main__":
    main()
