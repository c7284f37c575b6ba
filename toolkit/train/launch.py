"""Start training for `parakit train`: in this process for one rank, else through torchrun; a stop
signal stops every rank (toolkit.train.stop).

parakit never implements a process launcher: several local ranks run under torchrun
(`--standalone`, with --max-restarts), exactly as launch.sh starts them, through
toolkit.train.torchrun, which reports failed ranks in one message.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path

from toolkit.config.schema import Config
from toolkit.emit.launch import REQUEST, rank_env
from toolkit.formats.atomic import write_atomic
from toolkit.plan.backends import backend_of
from toolkit.plan.layout import Layout
from toolkit.train.stop import Stopped, run_group, stoppable
from toolkit.train.torchrun import torchrun_command, torchrun_env


def train_here(cfg: Config, layout: Layout, run_dir: Path, detach: bool = False) -> int:
    """One node: the ranks run here (this process, or torchrun's). Several: a Slurm job
    (toolkit.train.slurm) that `detach` leaves running instead of following its logs. The caller
    has written the run files after `refuse_to_start`."""
    if cfg.cluster.nodes > 1 and "LOCAL_RANK" not in os.environ:
        from toolkit.train.slurm import submit

        return submit(cfg, run_dir, detach)
    graceful = _save_and_stop(run_dir) if cfg.train.fault.save_on_stop else None
    if "LOCAL_RANK" in os.environ:  # a rank under torchrun: torchrun stops it
        return _train_in_this_process(cfg, run_dir)
    if backend_of(cfg).name == "megatron":
        from toolkit.train.megatron_reshard import convert_for_layout

        convert_for_layout(cfg, layout, run_dir)
    if layout.world_size == 1:
        with stoppable(graceful) as received:
            code = _train_in_this_process(cfg, run_dir)
        if received:  # stopped at a step boundary with its checkpoint
            raise Stopped(received[0])
        return code
    print(f"parakit train: starting {layout.world_size} ranks with torchrun", flush=True)
    command = torchrun_command(run_dir, layout.world_size, cfg.train.fault.max_restarts)
    return run_group(command, env=torchrun_env(cfg), graceful=graceful)


def refuse_to_start(cfg: Config, run_dir: Path) -> None:
    """(the machine that starts the ranks, before it writes the run's files) Raise ResumeError,
    saying why and the fix, where this run must not start: its train.init_checkpoint is incomplete
    or unsealed; its train.save_init_checkpoint would write into a folder with files in it;
    the checkpoints it would resume hold another model; checkpoint.resume=false over published
    checkpoints; or the earlier run in this run directory saved elsewhere than this run would. A
    resume at another global batch is said, not refused (a batch ramp-up is one)."""
    from toolkit.train.checkpoint import (
        ResumeError,
        dist_checkpoint_problem,
        init_checkpoint_model,
        other_batch,
        other_model,
        refuse_to_start_over,
    )
    from toolkit.train.loop import checkpoint_root

    if cfg.train.init_checkpoint and (problem := dist_checkpoint_problem(cfg.train.init_checkpoint)):
        raise ResumeError(
            f"train.init_checkpoint={cfg.train.init_checkpoint}: {problem}; write it again "
            "(train.save_init_checkpoint, or parakit convert hf-to-megatron)"
        )
    if cfg.train.init_checkpoint and (problem := init_checkpoint_model(cfg.train.init_checkpoint, cfg)):
        raise ResumeError(
            f"train.init_checkpoint={cfg.train.init_checkpoint}: {problem}. Fix: point it at weights of this model, "
            "or configure the model they hold"
        )
    target = cfg.train.save_init_checkpoint
    if target and Path(target).is_dir() and any(Path(target).iterdir()):
        raise ResumeError(
            f"train.save_init_checkpoint={target} is a folder with files in it, which this run would write over. "
            "Fix: name a new folder, or remove that one first"
        )
    root = checkpoint_root(cfg, run_dir)
    if not cfg.checkpoint.resume:
        refuse_to_start_over(root, None)
        return
    if problem := other_model(cfg, root):
        raise ResumeError(f"{problem}. Fix: give this run another checkpoint.dir, or the saved model's settings")
    if note := other_batch(cfg, root):
        print(f"warning [resume_batch] {note}", file=sys.stderr, flush=True)
    earlier = _earlier_run_checkpoints(run_dir)
    if earlier is not None and earlier.resolve() != root.resolve() and any(earlier.glob("step_*")):
        raise ResumeError(
            f"the earlier run in {run_dir} saved its checkpoints in {earlier}, and this run's would go to {root}: "
            f"it would start from step 0 beside them. Fix: set checkpoint.dir={earlier} to resume it, or give "
            "this run another hydra.run.dir"
        )


def _earlier_run_checkpoints(run_dir: Path) -> Path | None:
    """Where the run that wrote run_dir/config.yaml saved its checkpoints; None where there is none,
    or its checkpoint.dir was relative (resolved against a working directory no longer known)."""
    from omegaconf import OmegaConf

    from toolkit.train.loop import checkpoint_folder

    try:
        saved = OmegaConf.select(OmegaConf.load(run_dir / "config.yaml"), "checkpoint.dir", default=None)
    except (OSError, ValueError):  # none yet, or not this program's YAML
        return None
    root = checkpoint_folder(saved, run_dir)
    return root if root.is_absolute() else None


def _train_in_this_process(cfg: Config, run_dir: Path) -> int:
    from toolkit.train.trainer import quiet_upstream_notices, run_to_exit_code

    for name, value in rank_env(cfg.cluster.device).items():  # before CUDA starts in this process
        os.environ.setdefault(name, value)
    quiet_upstream_notices()
    return run_to_exit_code(cfg, run_dir)


def _save_and_stop(run_dir: Path):
    """train.fault.save_on_stop: the first stop signal asks the ranks to stop after the step
    they are in, with its checkpoint (the preemption request, toolkit.train.preemption)."""

    def ask(signum: int) -> bool:
        write_atomic(run_dir / REQUEST, f"{signal.Signals(signum).name}\n")
        print(
            f"parakit train: {signal.Signals(signum).name}: saving after this step, then stopping "
            "(signal again to stop at once)",
            flush=True,
        )
        return True

    return ask


def dry_run(cfg: Config, layout: Layout, run_dir: Path) -> int:
    """`parakit train --dry-run`: what train would start, started not."""
    if cfg.cluster.nodes > 1:
        from toolkit.train.slurm import dry_run as slurm_dry_run

        return slurm_dry_run(cfg, run_dir)
    if layout.world_size == 1:
        print(f"would train in this process: python -m toolkit.train --config-dir {run_dir} --config-name config")
    else:
        command = torchrun_command(run_dir, layout.world_size, cfg.train.fault.max_restarts)
        print(f"would run: {shlex.join(command)}")
    print("dry run: nothing started")
    return 0
