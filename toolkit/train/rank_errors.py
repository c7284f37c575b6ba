"""Errors from the ranks, reported once: a failing rank records its error where torchrun's agent
collects it, and the launcher (toolkit.train.torchrun) prints one message for the job instead of
a traceback per rank followed by torchrun's ChildFailedError.

This is torchrun's own mechanism (torch/distributed/elastic/multiprocessing/errors/__init__.py):
the agent gives every rank an error file (TORCHELASTIC_ERROR_FILE) and, when ranks fail, raises
ChildFailedError with a ProcessFailure per failed rank that has read it. A rank writes the file
in the format of torch's ErrorHandler.record_exception, with two additions under
extraInfo.parakit: the exact time (torch's timestamp is in whole seconds, too coarse to tell
which rank failed first) and where the full traceback is (RUN_DIR/errors/rank{R}.txt). Plain
torchrun shows the same cause in its summary.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ERRORS_DIR = "errors"  # in the run directory: one traceback file per failed rank
# Ranks torchrun stopped because another failed: SIGTERM, or the exit code of the rank's SIGTERM
# handler (toolkit.train.distributed.end_helpers_on_sigterm).
_STOPPED = {-signal.SIGTERM, 128 + signal.SIGTERM}


def _error_file() -> str:
    """This rank's torchrun error file; "" when no torchrun agent collects errors."""
    return os.environ.get("TORCHELASTIC_ERROR_FILE", "")


def _restarts_left() -> bool:
    """torchrun will start the ranks again after this failure (the launcher hears of the last only)."""
    return _restart() < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))


def _restart() -> int:
    """The attempt this is: how often torchrun has restarted the ranks on this node."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _write(path: Path, text: str) -> None:
    """Atomically: the agent reads the error file once the rank has ended, never half of it."""
    from toolkit.formats.atomic import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)


def _record(cause: str, callstack: str, traceback_file: str | None) -> None:
    now = time.time()
    extra = {"py_callstack": callstack, "timestamp": str(int(now))}  # torch's ErrorHandler.record_exception
    extra["parakit"] = {"time": now, "traceback": traceback_file}
    _write(Path(_error_file()), json.dumps({"message": {"message": cause, "extraInfo": extra}}))


def known(cause: str) -> None:
    """A failure parakit explains in one line (what and the fix): printed here when this process
    trains alone or torchrun will restart the ranks, else left for the launcher to print once."""
    if _error_file() and not _restarts_left():
        _record(cause, cause, None)
    else:
        print(f"parakit train: {cause}", file=sys.stderr, flush=True)


def unexpected(error: Exception, run_dir: Path) -> bool:
    """An exception nothing foresaw, on a rank torchrun started: its traceback goes to
    RUN_DIR/errors/rank{R}.txt and the cause to the launcher; this rank prints one line only when
    torchrun will restart the ranks. False when no torchrun agent collects it (let it raise)."""
    if not _error_file():
        return False
    rank, restart = int(os.environ.get("RANK", "0")), _restart()
    path = Path(run_dir).absolute() / ERRORS_DIR / f"rank{rank}{f'.restart{restart}' if restart else ''}.txt"
    callstack = "".join(traceback.format_exception(error))
    cause = f"{type(error).__name__}: {error}"
    _write(path, callstack)
    _record(cause, callstack, str(path))
    if _restarts_left():
        print(
            f"parakit train: rank {rank} failed: {cause} (traceback: {path}); torchrun restarts the ranks",
            file=sys.stderr,
            flush=True,
        )
    return True


# ---------------------------------------------------------------- the launcher's side
@dataclass(frozen=True)
class _Failure:
    rank: int
    cause: str
    time: float
    traceback: str | None  # the file, for an exception
    stopped: bool  # torchrun stopped it after another rank failed


def _failure(rank: int, failure) -> _Failure:
    """What a ProcessFailure (torch.distributed.elastic.multiprocessing.errors) says."""
    message, code = failure.error_file_data.get("message"), failure.exitcode
    if isinstance(message, dict):  # a rank recorded an exception (this module, or torch's @record)
        ours = message.get("extraInfo", {}).get("parakit", {})
        return _Failure(
            rank, message.get("message", "?"), ours.get("time", failure.timestamp), ours.get("traceback"), False
        )
    if code < 0:
        cause = f"killed by {failure.signal_name()}"
    else:
        cause = f"exitcode {code} (no error recorded: its output above says why)"
    return _Failure(rank, cause, failure.timestamp, None, code in _STOPPED)


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")
    return f"rank{'s' * (len(ranks) > 1)} {shown}"


def summary(failures: dict) -> str:
    """One message for ChildFailedError.failures ({global rank: ProcessFailure}): the first cause
    with every rank that failed of it and where its traceback is, then what failed after it."""
    found = sorted((_failure(rank, f) for rank, f in failures.items()), key=lambda f: (f.stopped, f.time, f.rank))
    first = found[0]
    same = [f for f in found if f.cause == first.cause]
    after = [f for f in found if f.cause != first.cause and not f.stopped]
    lines = [f"parakit train: {_ranks(sorted(f.rank for f in same))} failed{' first' * bool(after)}: {first.cause}"]
    if first.traceback:
        where = f" (each failing rank's in {Path(first.traceback).parent})" if len(same) > 1 else ""
        lines.append(f"  traceback: {first.traceback}{where}")
    causes = {f.cause: sorted(g.rank for g in after if g.cause == f.cause) for f in after}  # first seen first
    lines += [f"  then {_ranks(ranks)}: {cause}" for cause, ranks in list(causes.items())[:3]]
    if len(causes) > 3:
        lines.append(f"  and {len(causes) - 3} other cause(s)")
    return "\n".join(lines)
