"""The default process group, for both backends."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch

# A collective that waits longer than this fails instead of hanging (Megatron-LM's default is
# also 10 minutes); PARAKIT_DIST_TIMEOUT_S overrides it.
TIMEOUT = timedelta(seconds=float(os.environ.get("PARAKIT_DIST_TIMEOUT_S", 600)))


def init_process_group() -> None:
    """NCCL on GPUs, gloo on CPU, meeting in the store torchrun hands each attempt (a fresh one
    per restart: toolkit.emit.launch.TORCHRUN_ENV)."""
    if torch.distributed.is_initialized():
        return
    if "RANK" not in os.environ:  # a single process outside torchrun
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", str(29400 + os.getpid() % 1000)),
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if local_restarts() and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print(
            "parakit: restarted ranks meet in the store torchrun's agents share, where peers' old addresses "
            "can hang them; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (launch.sh does)",
            file=sys.stderr,
            flush=True,
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend, timeout=TIMEOUT)
    global _job_restarts
    counts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(counts, local_restarts())
    _job_restarts = max(counts)


# The job's restarts as every rank agrees on them (init_process_group): the most any node's agent
# counts. torchrun counts failures only: an agent whose ranks restart because a peer agent came
# back to the rendezvous (a membership change) still counts 0 on the job's second attempt.
_job_restarts: int | None = None


def local_restarts() -> int:
    """How often this node's torchrun agent has restarted its ranks (each agent counts its own)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def job_restarts() -> int:
    """How often the job has restarted (0 on its first attempt); this node's agent's count
    where parakit did not start the process group."""
    return local_restarts() if _job_restarts is None else _job_restarts


def end_process_group() -> None:
    """Every rank is done: leave together, then tear the group down explicitly (gloo can abort
    at interpreter shutdown otherwise)."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def detach_resource_tracker() -> None:
    """Start multiprocessing's resource tracker now, with /dev/null as its stdout and stderr.

    Libraries start it lazily from a rank; it inherits the rank's stdout/stderr and outlives a
    killed rank, holding the launcher's pipes open (a caller waiting for end-of-output hangs)."""
    from multiprocessing import resource_tracker

    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (devnull, *saved):
            os.close(fd)


def end_helper_processes() -> None:
    """Kill the processes this rank started (multiprocessing's resource tracker, which ignores
    SIGTERM, and the writer processes dist_checkpointing spawns), so that none is left behind
    when the rank ends, normally or not."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def end_helpers_on_sigterm() -> None:
    """torchrun stops the ranks with SIGTERM when one fails: take the helpers along."""
    import signal

    def handler(signum, frame):
        end_helper_processes()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
