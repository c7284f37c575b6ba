"""The manifest beside a prepared dataset: what a prefix holds and how it was tokenized.

A prepared dataset is four siblings: PREFIX.bin and PREFIX.idx (a Megatron indexed dataset),
PREFIX.tokenizer/ (the tokenizer's files, so that the dataset is self-contained: training reads
the vocabulary from here, export copies the files next to the weights) and PREFIX.manifest.json,
published last: a prefix with a manifest is complete. Pure json: the validator reads it without
torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from toolkit.formats.atomic import write_atomic

FORMAT = 1


@dataclass
class SourceFile:
    path: str
    bytes: int
    sha256: str
    documents: int = 0


@dataclass
class Manifest:
    tokenizer: str  # "gpt2" (bundled) or the directory it was loaded from
    tokenizer_class: str
    vocab_size: int  # every id is below this (len(tokenizer), added tokens included)
    eod: int  # appended to every document
    dtype: str  # numpy dtype of the stored ids
    documents: int
    tokens: int
    sources: list[SourceFile] = field(default_factory=list)
    skipped_lines: int = 0  # bad lines passed over with --skip-bad-lines
    empty_documents: int = 0  # documents with no text, not stored
    format: int = FORMAT

    def write(self, path: Path) -> None:
        write_atomic(path, json.dumps(asdict(self), indent=2) + "\n")


def manifest_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.manifest.json")


def tokenizer_dir(prefix: str | Path) -> Path:
    return Path(f"{prefix}.tokenizer")


def read_manifest(prefix: str | Path) -> Manifest | None:
    """The manifest of a prepared prefix; None for a prefix without one (an indexed dataset made by
    other tools, e.g. Megatron-LM's tools/preprocess_data.py)."""
    path = manifest_path(prefix)
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    raw["sources"] = [SourceFile(**s) for s in raw.get("sources", [])]
    return Manifest(**raw)


def parse_blend(path: str) -> tuple[list[str], list[float] | None]:
    """data.path as Megatron-LM's --data-path takes it: one prefix, or "W1 PREFIX1 W2 PREFIX2 ..."
    (a blend sampled in proportion to the weights). Raises ValueError naming the problem."""
    words = path.split()
    if len(words) == 1:
        return words, None
    if len(words) % 2:
        raise ValueError(f"data.path={path!r}: a blend is weight-prefix pairs, 'W1 PREFIX1 W2 PREFIX2 ...'")
    weights, prefixes = words[0::2], words[1::2]
    try:
        values = [float(w) for w in weights]
    except ValueError:
        raise ValueError(
            f"data.path={path!r}: in a blend every prefix follows its weight ('0.7 /data/web 0.3 /data/code')"
        ) from None
    if any(v <= 0 for v in values):
        raise ValueError(f"data.path={path!r}: blend weights must be positive")
    return prefixes, values


def describe(path: str, fallback_tokenizer: str) -> str:
    """data.path in a few words: each prefix with what its manifest says (for the summary)."""
    prefixes, weights = parse_blend(path)
    parts = []
    for i, prefix in enumerate(prefixes):
        m = read_manifest(prefix)
        what = (
            f"{m.documents:,} documents, {m.tokens:,} tokens, tokenizer {m.tokenizer}, vocab {m.vocab_size:,}"
            if m
            else f"no manifest, tokenizer {fallback_tokenizer}"
        )
        parts.append(f"{'' if weights is None else f'{weights[i]:g} x '}{prefix}: {what}")
    return "; ".join(parts)
