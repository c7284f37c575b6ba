"""Publishing a file or a folder whole and durable: readers (a resumed run, a sweep's aggregation, the
validator) never see half of one, a failure leaves the previous version in place, and what is
published survives a power loss.

A rename publishes; it is durable only once the folder that holds it is fsynced, and it publishes
bytes only if they were fsynced before it (the order PostgreSQL's durable_rename and ext4's
documentation give: file data, then the rename, then the parent directory). Files are created as
the process's umask allows, as open(2) would, never more widely.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def process_umask() -> int:
    """This process's umask, read without changing it (Linux's /proc/self/status, kernel 4.7+);
    elsewhere set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode(executable: bool = False) -> int:
    """The mode open(2) gives a new file under this process's umask (0o666, or 0o777 for a script)."""
    return (0o777 if executable else 0o666) & ~process_umask()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_file = fsync_path


def fsync_tree(directory: Path, files: bool = True) -> None:
    """Every file (unless `files` is False: already synced by whoever wrote them) and every folder
    under `directory`, the deepest folders first, `directory` last."""
    for folder, _, names in os.walk(directory, topdown=False):
        if files:
            for name in names:
                fsync_path(Path(folder) / name)
        fsync_path(Path(folder))


def durable_rename(source: Path, target: Path, replace: bool = False) -> None:
    """Rename `source` (its contents already on disk) to `target` and fsync the folder that holds
    the new name. `replace`: os.replace (over a file); else os.rename, which fails rather than merge
    into a folder made meanwhile."""
    (os.replace if replace else os.rename)(source, target)
    fsync_path(Path(target).parent)


def write_atomic(path: Path, text: str, executable: bool = False) -> None:
    """Write to a temporary file beside `path`, fsync it, then rename it over `path` and fsync the
    folder: readers never see half a file, and the new one is on disk when this returns."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), file_mode(executable))  # mkstemp's 0600, widened only as the umask allows
            os.fsync(f.fileno())
        durable_rename(Path(tmp), path, replace=True)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def publish_directory(staging: Path, output: Path, synced_files: bool = False) -> None:
    """Make `staging`'s files and folders durable, then rename it to `output` durably (fails rather
    than merge into an `output` made meanwhile). `synced_files`: its files are on disk already."""
    fsync_tree(staging, files=not synced_files)
    durable_rename(staging, output)


@contextlib.contextmanager
def staged_directory(output: Path):
    """A fresh hidden directory beside `output` to write into; published to `output`
    (publish_directory) when the block ends normally, removed when it raises. A killed process
    leaves only `.NAME.partial-PID`, which looks like nothing finished."""
    if output.exists():
        raise FileExistsError(f"{output} already exists: choose another --output or remove it first")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        publish_directory(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
