"""Start training for `parakit train`: in this process for one rank, else through torchrun.

parakit never implements a process launcher: several local ranks run under torchrun
(`--standalone`, with --max-restarts), exactly as launch.sh starts them, through
toolkit.train.torchrun, which reports failed ranks in one message.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from toolkit.config.schema import Config
from toolkit.emit.launch import TORCHRUN_ENV, rank_env
from toolkit.plan.layout import Layout


def torchrun_command(layout: Layout, run_dir: Path, nproc: int, max_restarts: int = 0) -> list[str]:
    """torchrun (toolkit.train.torchrun: failed ranks reported in one message) on this node."""
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
    ]


def torchrun_env(cfg: Config) -> dict[str, str]:
    """The environment torchrun runs in, as launch.sh sets it."""
    env = {**os.environ, **TORCHRUN_ENV, **rank_env(cfg.cluster.device)}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def train_here(cfg: Config, layout: Layout, run_dir: Path, detach: bool = False) -> int:
    """One node: the ranks run here (this process, or torchrun's). Several: a Slurm job
    (toolkit.train.slurm) that `detach` leaves running instead of following its logs."""
    if cfg.cluster.nodes > 1 and "LOCAL_RANK" not in os.environ:
        from toolkit.train.slurm import submit

        return submit(cfg, run_dir, detach)
    if layout.world_size == 1 or "LOCAL_RANK" in os.environ:
        from toolkit.train.trainer import quiet_upstream_notices, run_to_exit_code

        for name, value in rank_env(cfg.cluster.device).items():  # before CUDA starts in this process
            os.environ.setdefault(name, value)
        quiet_upstream_notices()
        return run_to_exit_code(cfg, run_dir)
    env = torchrun_env(cfg)
    print(f"parakit train: starting {layout.world_size} ranks with torchrun", flush=True)
    command = torchrun_command(layout, run_dir, layout.world_size, cfg.train.fault.max_restarts)
    # A session of its own: when torchrun is done, whatever its ranks left behind (e.g. the
    # multiprocessing resource trackers of ranks that were killed, which hold our stdout open)
    # goes with it.
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        return proc.wait()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def dry_run(cfg: Config, layout: Layout, run_dir: Path) -> int:
    """`parakit train --dry-run`: what train would start, started not."""
    if cfg.cluster.nodes > 1:
        from toolkit.train.slurm import dry_run as slurm_dry_run

        return slurm_dry_run(cfg, run_dir)
    if layout.world_size == 1:
        print(f"would train in this process: python -m toolkit.train --config-dir {run_dir} --config-name config")
    else:
        command = torchrun_command(layout, run_dir, layout.world_size, cfg.train.fault.max_restarts)
        print(f"would run: {shlex.join(command)}")
    print("dry run: nothing started")
    return 0
