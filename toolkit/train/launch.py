"""Start training for `parakit train`: in this process for one rank, else through torchrun.

parakit never implements a process launcher: several local ranks run under torchrun
(`--standalone`, with --max-restarts), exactly as launch.sh starts them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from toolkit.config.schema import Config
from toolkit.plan.layout import Layout


def torchrun_command(layout: Layout, run_dir: Path, nproc: int, max_restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
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


def train_here(cfg: Config, layout: Layout, run_dir: Path) -> int:
    if cfg.cluster.nodes > 1:
        print(
            f"parakit train: {cfg.cluster.nodes} nodes: submit {run_dir / 'launch.sh'} with sbatch instead",
            file=sys.stderr,
        )
        return 2
    if layout.world_size == 1 or "LOCAL_RANK" in os.environ:
        from toolkit.train.trainer import quiet_upstream_notices, run_to_exit_code

        quiet_upstream_notices()
        return run_to_exit_code(cfg, run_dir)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if cfg.cluster.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
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
