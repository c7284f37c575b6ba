"""PYTHON_EXEC for torchrun's ranks in the test suite (tests/warm/server.py): ask the warm server
to fork this rank; end as the rank ended. Without a server, or when it answers "cold", run Python
itself. Runs without site-packages (python -IS): it imports the standard library only."""

import json
import os
import signal
import socket
import sys


def _cold() -> None:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


def main() -> None:
    path = os.environ.get("PARAKIT_WARM_RANKS")
    if not path:
        _cold()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:  # not ready yet, or gone
        _cold()
    here = os.path.abspath(sys.argv[0])
    request = {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "client": here}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    replies = conn.makefile("rb")
    if replies.readline() != b"ok\n":
        conn.close()
        _cold()

    def forward(signum, frame):
        conn.sendall(f"signal {signum}\n".encode())

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
        signal.signal(signum, forward)
    line = replies.readline()
    if not line.startswith(b"exit "):  # the relay died: report a crash
        sys.exit(1)
    status = int(line.split()[1])
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    sys.exit(os.waitstatus_to_exitcode(status))


main()
