"""Shared data for the data tests: the bundled corpus as a jsonl file (one chapter per line,
4 MB) and a tokenizer trained on it whose vocabulary exceeds 65,535 (scripts/train_tokenizer.py:
64,000 reserved ids first, so that most ordinary ids lie above 65,535)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from toolkit.data.corpus import kjv_chapters

RESERVED, LEARNED = 64_000, 12_000


def write_corpus_jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in kjv_chapters()))
    return path


def train_big_tokenizer(corpus: Path, output: Path) -> Path:
    spec = importlib.util.spec_from_file_location(
        "train_tokenizer", Path(__file__).parents[1] / "scripts" / "train_tokenizer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.train_tokenizer([corpus], output, vocab_size=LEARNED, reserved=RESERVED)
    return output
