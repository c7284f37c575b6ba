"""A quiet console: other libraries' INFO logs (megatron-core's gradient buckets and their every
parameter, DeepSpeed's optimizer memory per group, ...) go to the run directory's log files only;
the terminal shows warnings, errors and parakit's own lines. `parakit train --verbose`
(PARAKIT_VERBOSE=1, inherited by the ranks) shows everything.

The log files: the `parakit` process's Hydra log (RUN_DIR/parakit.log, which takes a rank trained
in that process), and RUN_DIR/logs/rankR.log for each rank torchrun starts.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from pathlib import Path

VERBOSE_ENV = "PARAKIT_VERBOSE"
OWN_LOGGERS = ("toolkit", "hydra", "__main__")  # parakit's, and Hydra's (its multirun's job lines)
FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's job log format


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


class OtherLibrariesInfo(logging.Filter):
    """Lets warnings and above, and parakit's and Hydra's own records, through (all with --verbose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.split(".")[0] in OWN_LOGGERS or verbose()


def _terminal_handlers(logger: logging.Logger) -> list[logging.Handler]:
    return [h for h in logger.handlers if type(h) is logging.StreamHandler]  # not the file handlers


def quiet_console() -> None:
    """Filter the terminal's handlers of the root logger (where Hydra's job logging and
    megatron-core's loggers write); the file handlers keep everything."""
    # MLflow gives its loggers a terminal handler of their own unless told not to (mlflow/__init__.py);
    # set before any process of the run imports it (the validator's package check does)
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    for handler in _terminal_handlers(logging.getLogger()):
        if not any(isinstance(f, OtherLibrariesInfo) for f in handler.filters):
            handler.addFilter(OtherLibrariesInfo())


def log_rank_to_file(run_dir: Path, rank: int) -> None:
    """A rank under torchrun: every record at INFO and above to RUN_DIR/logs/rankR.log, and the
    terminal's share (stderr) filtered."""
    root = logging.getLogger()
    if not root.handlers:
        terminal = logging.StreamHandler(sys.stderr)
        terminal.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(terminal)
    path = Path(run_dir) / "logs" / f"rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    file = logging.FileHandler(path)
    file.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(file)
    root.setLevel(logging.INFO)
    quiet_console()


class _LinesToLog(io.TextIOBase):
    """A text stream whose lines become INFO records of a logger."""

    def __init__(self, logger: logging.Logger):
        self.logger, self.pending = logger, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self.logger.info(line)
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.logger.info(self.pending)
            self.pending = ""


@contextlib.contextmanager
def prints_logged(name: str):
    """What a library print()s meanwhile (DeepSpeed's see_memory_usage around its optimizer's
    groups) becomes INFO records of logger `name`: in the log files, on the terminal with --verbose."""
    if verbose():
        yield
        return
    stream = _LinesToLog(logging.getLogger(name))
    with contextlib.redirect_stdout(stream):
        try:
            yield
        finally:
            stream.flush()
