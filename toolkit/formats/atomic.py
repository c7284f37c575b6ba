"""Publishing a file or a folder whole: readers (a resumed run, a sweep's aggregation, the validator) never see
half of one, and a failure leaves the previous version in place."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def staged_directory(output: Path):
    """A fresh hidden directory beside `output` to write into; renamed to `output` when the block
    ends normally, removed when it raises. A killed process leaves only `.NAME.partial-PID`,
    which looks like nothing finished."""
    if output.exists():
        raise FileExistsError(f"{output} already exists: choose another --output or remove it first")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        for path in staging.iterdir():  # the rename publishes the files: they must be on disk first
            if path.is_file():
                fsync_file(path)
        os.rename(staging, output)  # fails rather than merge into an `output` made meanwhile
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
