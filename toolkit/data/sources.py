"""Documents read from the input files, with the file and line of every problem.

Formats, by extension (or --format): jsonl (.jsonl, .json; one JSON object per line, the text
under --text-key), plain text (.txt; the whole file is one document) and parquet (.parquet; the
text column named by --text-key). Each file is hashed (sha256) as it is read, for the manifest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from toolkit.formats.manifest import SourceFile

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".txt": "text", ".text": "text", ".parquet": "parquet"}


class BadInput(ValueError):
    """An input problem, its message naming the file (and line) and the fix."""


@dataclass
class Tally:
    """What reading skipped: bad lines (with --skip-bad-lines) and documents without text."""

    skip_bad_lines: bool
    bad_lines: int = 0
    first_bad: str | None = None
    empty_documents: int = 0

    def bad(self, where: str, why: str) -> None:
        if not self.skip_bad_lines:
            raise BadInput(f"{where}: {why} (fix the line, or pass --skip-bad-lines to skip such lines)")
        self.bad_lines += 1
        self.first_bad = self.first_bad or f"{where}: {why}"


def input_format(path: Path, forced: str | None) -> str:
    if forced:
        return forced
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise BadInput(
            f"{path}: unknown input format {path.suffix!r}; name the file .jsonl, .txt or .parquet, or pass --format"
        )
    return fmt


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _jsonl(path: Path, text_key: str, tally: Tally, digest) -> Iterator[str]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            digest.update(raw)
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                tally.bad(where, f"bytes that are not UTF-8 at column {e.start + 1}")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                tally.bad(where, f"broken JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(record, dict) or text_key not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                tally.bad(where, f"no {text_key!r} key (has {keys}); pass --text-key to read another")
                continue
            if not isinstance(record[text_key], str):
                tally.bad(where, f"{text_key!r} is a {type(record[text_key]).__name__}, not text")
                continue
            yield record[text_key]


def _text(path: Path, tally: Tally, digest) -> Iterator[str]:
    raw = path.read_bytes()
    digest.update(raw)
    try:
        yield raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        tally.bad(f"{path}:{line}", "bytes that are not UTF-8")


def _parquet(path: Path, text_key: str, tally: Tally) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and OSError subclasses
        raise BadInput(f"{path}: not a readable parquet file ({e})") from None
    if text_key not in table.schema_arrow.names:
        raise BadInput(f"{path}: no {text_key!r} column (has {table.schema_arrow.names}); pass --text-key")
    row = 0
    for batch in table.iter_batches(columns=[text_key], batch_size=1024):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                tally.bad(f"{path}: row {row}", f"{text_key!r} is {text!r}, not text")
                continue
            yield text


def read_documents(
    paths: list[Path], text_key: str, tally: Tally, sources: list[SourceFile], fmt: str | None = None
) -> Iterator[str]:
    """Every document of every file, in order; appends each file's SourceFile to `sources` once read."""
    for path in paths:
        kind = input_format(path, fmt)
        digest = hashlib.sha256()
        count = 0
        if kind == "jsonl":
            documents = _jsonl(path, text_key, tally, digest)
        elif kind == "text":
            documents = _text(path, tally, digest)
        else:
            documents = _parquet(path, text_key, tally)
        for text in documents:
            if not text.strip():
                tally.empty_documents += 1
                continue
            count += 1
            yield text
        sha = sha256_of(path) if kind == "parquet" else digest.hexdigest()
        sources.append(SourceFile(str(path.resolve()), path.stat().st_size, sha, count))


def check_inputs(paths: list[Path], fmt: str | None) -> None:
    """Refuse missing or unreadable inputs before any work starts."""
    if not paths:
        raise BadInput("no input files given: parakit data prepare INPUT... --output PREFIX")
    for path in paths:
        if not path.is_file():
            raise BadInput(f"{path}: no such file")
        input_format(path, fmt)
