"""Warm ranks for the test suite: a process that has imported torch, megatron-core, DeepSpeed and
transformers once forks every torchrun rank the tests start, instead of each rank importing them
again (~10 s a launch on 2 cores).

torchrun starts each rank as `$PYTHON_EXEC -u -m MODULE ARGS` (torch/distributed/run.py); the
suite points PYTHON_EXEC at tests/warm/python, a small client that hands its argv, environment,
working directory and stdin/stdout/stderr to this server over a Unix socket. For each request the
server forks a relay, which forks the rank (a copy of this process, in a process group of its
own, with the client's descriptors, environment and argv), passes on the signals the client gets
(torchrun stops ranks with SIGTERM to their process group) and sends back how the rank ended; the
client ends the same way. So torchrun still starts, watches, restarts and tears down the ranks; only
their imports are shared. A request whose import-time environment differs from the server's (a hash
seed, MKL's thread count, a PYTHONPATH that is not the server's with folders put in front, or whose
folders hold a module the server has imported) is answered "cold": the client then execs Python.
Folders put in front of PYTHONPATH (a mutation's sitecustomize, tests/mutants) go in front of the
rank's sys.path, and their sitecustomize runs before the rank's module, as Python's start-up would
do; OMP_NUM_THREADS (or torch's default without it) is set in the rank. In a rank, sys.executable
is the client, so the Python processes that parakit itself starts (torchrun, a sweep's points) are
forked warm too.

The server imports no parakit module: parakit reads some settings from the environment at import.
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback

# The environment variables that send a process's torchrun ranks (and tests/training_runs.parakit)
# to the server: the client's path and the server's socket.
WARM_ENV = ("PYTHON_EXEC", "PARAKIT_WARM_RANKS")
# Third-party packages a rank imports (their import is the cost shared); never toolkit.
PRELOAD = (
    "torch",
    "torch.distributed",
    "numpy",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer",
    "megatron.core.datasets.gpt_dataset",
    "megatron.core.dist_checkpointing",
    "deepspeed",
    "transformers",
    "hydra",
    "omegaconf",
    "safetensors.torch",
    "psutil",
)
# Read by these packages when they are imported: a rank whose values differ runs cold.
IMPORT_TIME_ENV = (
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "PYTHONWARNINGS",
    "MKL_NUM_THREADS",
    "DS_ACCELERATOR",
    "CUDA_VISIBLE_DEVICES",
    "TORCH_CPP_LOG_LEVEL",
    "TORCH_SHOW_CPP_STACKTRACES",
    "LD_PRELOAD",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
)


def ranks_dir(path: str) -> str:
    """Where the server records the ranks now running (one file per pid: argv and cwd)."""
    return path + ".ranks"


_ranks_dir = ""
# torch's intra-op threads where OMP_NUM_THREADS is not set (at::intraop_default_num_threads: the
# physical cores), asked of a Python started without it; the server itself runs with 1 thread, so
# that no OpenMP pool exists when it forks. A rank sets its own, as torch would have at import.
_default_threads = 0


def _added_path(env: dict) -> list[str] | None:
    """The folders the request's PYTHONPATH puts in front of the server's, or None where it is
    not the server's PYTHONPATH with folders in front."""
    own, theirs = os.environ.get("PYTHONPATH", ""), env.get("PYTHONPATH", "")
    if theirs == own:
        return []
    if own and not theirs.endswith(os.pathsep + own):
        return None
    added = (theirs[: -len(own) - 1] if own else theirs).split(os.pathsep)
    return None if any(_shadows(folder) for folder in added) else added


def _shadows(folder: str) -> bool:
    """Whether `folder` holds a top-level module the server has imported already (a cold start
    would import the folder's instead)."""
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return False
    return any(name.removesuffix(".py") in sys.modules for name in names if name != "sitecustomize.py")


def _program(argv: list[str]) -> list[str] | None:
    """`[-u] -m MODULE ARGS` or `[-u] SCRIPT.py ARGS` without the -u (a rank's streams are
    unbuffered anyway); None for anything else (-c, other options), which runs cold."""
    argv = argv[1:] if argv[:1] == ["-u"] else argv
    runnable = (argv[:1] == ["-m"] and len(argv) >= 2) or (argv[:1] != [] and argv[0].endswith(".py"))
    return argv if runnable else None


def _warm_request(request: dict) -> bool:
    """Whether the request can run warm; if so, the folders it adds to the path go in request["added"]."""
    env = request["env"]
    same = all(env.get(name) == os.environ.get(name) for name in IMPORT_TIME_ENV if name != "PYTHONPATH")
    threads = env.get("OMP_NUM_THREADS", "1")  # else torch's parser decides (e.g. "4,2" for nesting)
    request["added"] = _added_path(env)
    runnable = _program(request["argv"]) is not None and request["added"] is not None
    return same and runnable and threads.isdigit() and int(threads) > 0


class Rank:
    """What the forked rank runs: Python's own start-up for `-u -m MODULE ARGS` or `-u SCRIPT ARGS`."""

    def __init__(self, request: dict, fds: list[int]):
        self.request, self.fds = request, fds

    def run(self) -> int:
        for fd, target in zip(self.fds, (0, 1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(self.request["cwd"])
        os.environ.clear()
        os.environ.update(self.request["env"])
        # -u: unbuffered binary layer, text written through
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        for fd, name in ((1, "stdout"), (2, "stderr")):
            stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                                      errors="backslashreplace" if fd == 2 else None)  # fmt: skip
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        import torch

        threads = os.environ.get("OMP_NUM_THREADS")
        torch.set_num_threads(int(threads) if threads else _default_threads)
        sys.executable = self.request["client"]  # the rank's own Python children go warm too
        argv = _program(self.request["argv"])
        try:
            added = self.request["added"]
            sys.path[1:1] = added  # where PYTHONPATH's folders go at start-up
            if any(os.path.isfile(os.path.join(folder, "sitecustomize.py")) for folder in added):
                sys.modules.pop("sitecustomize", None)
                importlib.import_module("sitecustomize")  # as site does: the first one on the path
            if argv[0] == "-m":
                sys.argv = argv[1:]
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = argv
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as stop:
            code = stop.code
            if code is None or isinstance(code, int):
                return code or 0
            print(code, file=sys.stderr)
            return 1
        except BaseException:
            sys.excepthook(*sys.exc_info())
            return 1
        return 0


def _relay(conn: socket.socket, request: dict, fds: list[int]) -> Rank | None:
    """In the relay process: fork the rank, pass the client's signals on, report how it ended."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        conn.close()
        return Rank(request, fds)
    for fd in fds:
        os.close(fd)
    # What the rank runs, while it runs: its command line is the server's, so a test looking for
    # processes it left behind (tests/conftest.py) reads these instead.
    record = os.path.join(_ranks_dir, str(pid))
    with open(record, "w") as f:
        json.dump({"argv": request["argv"], "cwd": request["cwd"]}, f)
    conn.sendall(b"ok\n")
    pidfd = os.pidfd_open(pid)
    buffered, watched = b"", [conn, pidfd]
    while True:
        readable, _, _ = select.select(watched, [], [])
        if pidfd in readable:
            _, status = os.waitpid(pid, 0)
            os.unlink(record)
            try:
                conn.sendall(f"exit {status}\n".encode())
            except OSError:
                pass
            os._exit(0)
        data = conn.recv(4096)
        if not data:  # the client is gone (SIGKILL): so goes its rank, as torchrun expects
            _kill_group(pid, signal.SIGKILL)
            watched.remove(conn)
            continue
        buffered += data
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            _kill_group(pid, int(line.split()[1]))


def _kill_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not message.endswith(b"\n"):
        message += conn.recv(1 << 20)
    return json.loads(message), fds


def _preload() -> None:
    """Import as a CPU rank does (megatron-core without triton, and without torch.compile where
    parakit imports it so), then forget parakit's own modules: each rank imports them afresh."""
    from toolkit.compat import import_shims
    from toolkit.train import eager_imports

    import_shims()
    eager_imports.import_without_compiling("megatron.core")
    for name in PRELOAD:
        __import__(name)
    eager_imports.import_without_compiling("deepspeed.runtime.zero.muon.muon_optimizer")
    for name in [m for m in sys.modules if m == "toolkit" or m.startswith("toolkit.")]:
        del sys.modules[name]


def serve(path: str) -> Rank | None:
    """Accept requests until killed; returns only in a forked rank."""
    global _default_threads
    cold = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    threads = subprocess.Popen([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=cold,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    _preload()
    _default_threads = int(threads.communicate()[0].split()[-1])
    global _ranks_dir
    _ranks_dir = ranks_dir(path)
    os.makedirs(_ranks_dir, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # clients connect only once the imports are done
    print(f"warm ranks: ready, {len(sys.modules)} modules imported", flush=True)
    while True:
        readable, _, _ = select.select([listener], [], [], 1.0)
        while True:  # reap finished relays
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not readable:
            continue
        conn, _ = listener.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError):
            conn.close()
            continue
        if not _warm_request(request):
            for fd in fds:
                os.close(fd)
            conn.sendall(b"cold\n")
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            try:
                rank = _relay(conn, request, fds)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            return rank  # only the rank returns from _relay
        for fd in fds:
            os.close(fd)
        conn.close()


def _exit(code: int) -> None:
    """End as Python ends (non-daemon threads joined, atexit handlers run, streams flushed), but
    without tearing down the thousands of modules this process imported for the rank: ~1.5 s."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    rank = serve(sys.argv[1])
    _exit(rank.run())
