"""`python -m toolkit.train.torchrun ARGS`: torchrun, with the same arguments, whose failed ranks
are reported in one message (toolkit.train.rank_errors) instead of torchrun's ChildFailedError
traceback; exits 1 when ranks failed, as torchrun does, and 128 + the signal's number, without a
traceback, when a stop signal ended it (after its agent stopped the ranks). `torchrun_command` and
`torchrun_env` are how parakit starts it on one node (`parakit train`, sweeps, a checkpoint's
conversion), as launch.sh does.

torch.distributed.run's `main` is `run(parse_args(argv))` under `@record`, which lets the
ChildFailedError propagate as a traceback; here it is caught and summarised. (`@record` also
copies the first failure into the launcher's own error file when a parent agent set one; nothing
parakit starts does.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from toolkit.config.schema import Config
from toolkit.emit.launch import TORCHRUN_ENV, rank_env


def torchrun_command(run_dir: Path, nproc: int, max_restarts: int = 0, worker_args: tuple[str, ...] = ()) -> list[str]:
    """This module (torchrun, failed ranks reported in one message) on this node, each rank running
    the worker entry (toolkit.train.__main__) on the run directory's config.yaml."""
    return [
        sys.executable,
        "-m",
        "toolkit.train.torchrun",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "-m",
        "toolkit.train",
        "--config-dir",
        str(run_dir),
        "--config-name",
        "config",
        *worker_args,
    ]


def torchrun_env(cfg: Config) -> dict[str, str]:
    """The environment torchrun runs in, as launch.sh sets it."""
    env = {**os.environ, **TORCHRUN_ENV, **rank_env(cfg.cluster.device)}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from toolkit.train.rank_errors import summary

    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as failed:
        print(summary(failed.failures), file=sys.stderr, flush=True)
        return 1
    except SignalException as stopped:  # a stop signal: the agent has stopped the ranks (toolkit.train.stop)
        return 128 + int(stopped.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
