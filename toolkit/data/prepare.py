"""`parakit data prepare`: documents -> a Megatron indexed dataset (.bin/.idx through megatron-core's
IndexedDatasetBuilder), the tokenizer's files and a manifest, published atomically.

Tokenizing runs in `workers` processes (each loads the tokenizer once); results come back in
input order, so the dataset is the same for any number of workers. Every document ends with the
tokenizer's end-of-document id. Ids are stored as uint16 when the vocabulary fits, else int32
(megatron-core's DType.optimal_dtype). Everything is written into a hidden staging directory
beside the output and moved into place when complete, the manifest last: an interrupted or
failed run leaves nothing under PREFIX.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from toolkit.data.sources import BadInput, Tally, check_inputs, read_documents
from toolkit.formats.atomic import durable_rename, fsync_path, fsync_tree
from toolkit.formats.manifest import Manifest, SourceFile, manifest_path, tokenizer_dir

BUNDLED = "gpt2"  # the GPT-2 BPE files that ship with parakit's dependencies
CHUNK = 64  # documents per task sent to a worker


def load_tokenizer(spec: str):
    """The bundled GPT-2 BPE by name, or a Hugging Face tokenizer directory (read locally only)."""
    if spec == BUNDLED:
        from toolkit.data.bundled import load_tokenizer as bundled

        return bundled()
    path = Path(spec)
    if not path.is_dir():
        raise BadInput(f"--tokenizer {spec}: not a directory; give a Hugging Face tokenizer directory or 'gpt2'")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise BadInput(f"--tokenizer {spec}: not a loadable tokenizer directory ({e})") from None
    tokenizer.model_max_length = 10**12  # documents, not model inputs: no length warnings
    return tokenizer


def end_of_document(tokenizer, spec: str) -> int:
    eod = tokenizer.eos_token_id
    if eod is None:
        raise BadInput(f"--tokenizer {spec}: the tokenizer has no eos_token to end documents with; set one")
    return eod


_worker_tokenizer = None


def _start_worker(spec: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _worker_tokenizer = load_tokenizer(spec)


def _tokenize(texts: list[str]) -> list[list[int]]:
    return _worker_tokenizer(texts, add_special_tokens=False)["input_ids"]


def _chunks(documents: Iterable[str]) -> Iterator[list[str]]:
    iterator = iter(documents)
    while chunk := list(itertools.islice(iterator, CHUNK)):
        yield chunk


@dataclass
class Throughput:
    seconds: float
    workers: int
    documents: int
    tokens: int

    def __str__(self) -> str:
        per_s = self.tokens / max(self.seconds, 1e-9)
        return (
            f"{self.documents:,} documents, {self.tokens:,} tokens in {self.seconds:.1f} s: "
            f"{self.documents / max(self.seconds, 1e-9):,.0f} documents/s, {per_s:,.0f} tokens/s "
            f"({per_s / self.workers:,.0f} tokens/s per worker, {self.workers} worker(s))"
        )


def _tokenized(spec: str, documents: Iterable[str], workers: int) -> Iterator[list[list[int]]]:
    """Token ids of each chunk of documents, in input order. The files are read here, in the
    calling thread, so that a bad line raises where the caller can clean up; at most two chunks
    per worker are in flight."""
    if workers == 1:
        _start_worker(spec)
        yield from map(_tokenize, _chunks(documents))
        return
    import collections
    import multiprocessing

    # spawn: a forked child would inherit the parent's tokenizer threads and torch state.
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_start_worker, initargs=(spec,)) as pool:
        pending = collections.deque()
        for chunk in _chunks(documents):
            pending.append(pool.apply_async(_tokenize, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _progress(enabled: bool):
    from tqdm import tqdm

    return tqdm(desc="tokenizing", unit="doc", disable=not enabled, mininterval=1 if sys.stderr.isatty() else 30)


def write_dataset(
    documents: Iterable[str],
    output: Path,
    tokenizer_spec: str,
    workers: int = 1,
    sources: list[SourceFile] | None = None,
    tally: Tally | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> tuple[Manifest, Throughput]:
    """Tokenize `documents` into OUTPUT.{bin,idx,tokenizer/,manifest.json}, atomically."""

    from toolkit.compat import import_shims

    import_shims()
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

    output = Path(output)
    if manifest_path(output).exists() and not overwrite:
        raise BadInput(f"--output {output}: a prepared dataset is already there; pass --overwrite to replace it")
    if not output.parent.is_dir():
        raise BadInput(f"--output {output}: directory {output.parent} does not exist; create it first")
    sources = [] if sources is None else sources
    tally = tally or Tally(skip_bad_lines=False)
    tokenizer = load_tokenizer(tokenizer_spec)
    eod, vocab = end_of_document(tokenizer, tokenizer_spec), len(tokenizer)
    dtype = DType.optimal_dtype(vocab)
    staging = output.parent / f".{output.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        builder = IndexedDatasetBuilder(str(staging / "data.bin"), dtype=dtype)
        count = tokens = 0
        start = time.perf_counter()
        with _progress(progress) as bar:
            for chunk in _tokenized(tokenizer_spec, documents, workers):
                for ids in chunk:
                    ids.append(eod)
                    builder.add_document(np.asarray(ids, dtype=np.int64), [len(ids)])
                    tokens += len(ids)
                count += len(chunk)
                bar.update(len(chunk))
                bar.set_postfix(tokens_per_s=f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f}", refresh=False)
        builder.finalize(str(staging / "data.idx"))
        seconds = time.perf_counter() - start
        if count == 0:
            what = f"; {tally.bad_lines} bad line(s) skipped, first: {tally.first_bad}" if tally.bad_lines else ""
            raise BadInput(f"no documents with text in the input{what}; nothing was written")
        written = IndexedDataset(str(staging / "data"))  # read back what the trainer will read
        if len(written) != count or int(written.sequence_lengths.sum()) != tokens:
            raise RuntimeError(f"{staging}: wrote {len(written)} documents, expected {count}; nothing published")
        tokenizer.save_pretrained(str(staging / "tokenizer"))
        manifest = Manifest(
            tokenizer=tokenizer_spec if tokenizer_spec == BUNDLED else str(Path(tokenizer_spec).resolve()),
            tokenizer_class=type(tokenizer).__name__,
            vocab_size=vocab,
            eod=eod,
            dtype=np.dtype(dtype).name,
            documents=count,
            tokens=tokens,
            sources=sources,
            skipped_lines=tally.bad_lines,
            empty_documents=tally.empty_documents,
        )
        manifest.write(staging / "manifest.json")
        _publish(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest, Throughput(seconds, workers, count, tokens)


def _publish(staging: Path, output: Path) -> None:
    """Move the staged files into place, on disk first; the manifest goes first out and last in, so a
    prefix with a manifest is whole after a power loss too."""
    fsync_tree(staging)
    manifest_path(output).unlink(missing_ok=True)
    fsync_path(output.parent)  # the old manifest gone before anything it described changes
    shutil.rmtree(tokenizer_dir(output), ignore_errors=True)
    os.replace(staging / "tokenizer", tokenizer_dir(output))
    os.replace(staging / "data.bin", f"{output}.bin")
    os.replace(staging / "data.idx", f"{output}.idx")
    fsync_path(output.parent)
    durable_rename(staging / "manifest.json", manifest_path(output), replace=True)


def prepare(
    inputs: list[Path],
    output: Path,
    tokenizer_spec: str = BUNDLED,
    text_key: str = "text",
    workers: int = 1,
    skip_bad_lines: bool = False,
    fmt: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> tuple[Manifest, Throughput]:
    """Input files -> a prepared dataset at `output` (see the module docstring)."""
    check_inputs(inputs, fmt)
    tally, sources = Tally(skip_bad_lines), []
    documents = read_documents(inputs, text_key, tally, sources, fmt)
    manifest, throughput = write_dataset(
        documents, output, tokenizer_spec, workers, sources, tally, progress=progress, overwrite=overwrite
    )
    return manifest, throughput
