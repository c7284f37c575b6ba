"""A stop stops everything: SIGTERM, SIGINT or SIGHUP to a parakit command (what `timeout`, a
scheduler, Ctrl-C or a closed terminal sends) ends every process it started, then the command,
with exit code 128 + the signal's number (the shell's convention: 143 for SIGTERM, 130 for SIGINT).

Children run in a session of their own (a terminal's Ctrl-C reaches parakit alone, which stops them
in order) and get SIGTERM if parakit itself dies (Linux's PR_SET_PDEATHSIG), so that no rank trains
on after the command has gone. torchrun, on SIGTERM, stops its ranks (SIGTERM, SIGKILL after 30 s:
torch/distributed/elastic/agent/server/api.py); whatever is left after GRACE_S is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_S = 40.0  # torchrun's own grace for its ranks (30 s) and its exit
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Stopped(BaseException):
    """A stop signal ended the command, after what it started had ended. A BaseException, as
    KeyboardInterrupt: no `except Exception` on the way (Hydra's among them) swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def stoppable(graceful=None):
    """Within: a stop signal raises Stopped, unless `graceful(signum)` takes the first one (returns
    True: e.g. it asked the ranks to save and stop); a second signal raises at once. Yields the
    list of signals received, for the caller to raise Stopped once its graceful stop is done."""
    received: list[int] = []

    def handler(signum, frame):
        received.append(signum)
        if len(received) == 1 and graceful is not None and graceful(signum):
            return
        raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield received
    finally:
        for s, action in previous.items():
            signal.signal(s, action)


def _die_with_parent() -> None:  # in the child, before exec (Linux; elsewhere a kill -9 may orphan)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_group(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM to the child's process group, SIGKILL to what is left after `grace_s`."""
    for signum, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def run_group(command: list[str], env=None, stdout=None, timeout_s: float | None = None, graceful=None) -> int | None:
    """Run `command` in a session of its own: its exit code, None when it ran past `timeout_s`
    (then stopped). A stop signal stops it (or hands the first to `graceful`, and the command is
    waited for) and raises Stopped."""
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout is not None else None,
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )
    try:
        with stoppable(graceful) as received:
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                code = None
        if received:  # the graceful stop ran its course
            raise Stopped(received[0])
        return code
    finally:
        if proc.poll() is None:
            stop_group(proc)
        else:  # what its children left in its group (e.g. resource trackers holding our stdout)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
