"""The trainer's entry points: `run` trains a validated configuration in this process (one rank
of a torchrun job, or the only one), `run_to_exit_code` wraps it for a command line, and
`load_run_config` reads the config.yaml that `parakit generate`/`train` wrote.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from toolkit.config.schema import Config
from toolkit.plan.backends import backend_of
from toolkit.plan.validate import check
from toolkit.train import loop, oom
from toolkit.train.backends import trainer_module

# Upstream notices that say nothing about this run (missing optional kernels on CPU, API
# deprecations inside megatron-core and torch); anything else still prints.
_NOISE = (
    "Apex is not installed",
    "Transformer Engine and Apex are not installed",
    "MimoModelConfig is experimental",
    "is not a leaf Tensor is being accessed",
    "reduce_scatter_tensor` is deprecated",
    "pad token id in the tokenizer collides",
    "absl.logging is not installed",
    "GPTModel IS DEPRECATED",
    "full_param_layout not provided",
    "Rerun State Machine",
    "RerunStateMachine initialized",
    "all_gather_into_tensor` is deprecated",
    # torch.distributed.checkpoint, as megatron-core's resume calls it (nothing a user can change)
    "torch.distributed is disabled, unavailable or uninitialized",
    "The argument order of load has been changed",
    "we are deprecating ShardedTensor",
    "MPU is not provided, setting tp size to 1",  # DeepSpeed's universal load of a model without Megatron's mpu
    "full scope is deprecated",
    "MCore's async save is deprecated",
    "Could not determine rank from torch.distributed",  # megatron-core's dataset logging, one process
)
# Advice that matters on a GPU (launch and train_here set it there) but is printed on CPU too.
_CPU_NOISE = ("CUDA_DEVICE_MAX_CONNECTIONS",)  # megatron-core, at tp > 1


class _DropNoise(logging.Filter):
    def __init__(self, noise: tuple[str, ...]):
        super().__init__()
        self.noise = noise

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(noise in record.getMessage() for noise in self.noise)


def quiet_upstream_notices() -> None:
    import torch

    noise = _NOISE if torch.cuda.is_available() else _NOISE + _CPU_NOISE
    for text in noise:
        warnings.filterwarnings("ignore", message=f".*{text}.*")
    if not logging.getLogger().handlers:  # megatron-core's loggers propagate to the root handler
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_DropNoise(noise))
    logging.getLogger("DeepSpeed").addFilter(_DropNoise(noise))  # its own terminal handler, not the root's


def run(cfg: Config, run_dir: Path) -> list[float]:
    """Train `cfg` as this rank of the job (validated first: a ValidationError lists every error),
    writing checkpoints, metrics.jsonl, TensorBoard events and result.json under `run_dir`;
    returns the loss curve. The backend description names the module whose steps the loop drives."""
    from toolkit.train.capabilities import importable
    from toolkit.train.probe import MemoryProbe

    layout, _ = check(cfg, installed=importable)  # on every node that trains
    backend = backend_of(cfg)
    memory = MemoryProbe(profile_tensors=cfg.train.profile_memory)  # before the model exists
    oom.record_history(cfg)
    steps = trainer_module(backend.name).setup(cfg, layout)
    return loop.train(cfg, layout, run_dir, steps, backend.name, memory)


def run_to_exit_code(cfg: Config, run_dir: Path) -> int:
    """Train; a non-finite loss that stops the run (train.fault.nan_action=stop), Hugging Face
    weights that do not fit the model, or a checkpoint this layout cannot resume from, are
    reported in one line, not as a traceback, as is a save that runs out of disk space (the previous
    checkpoint kept), and running out of memory with what held it
    (toolkit.train.oom): 1; a configuration this node cannot train (a
    package it lacks) with its errors: 2. Under torchrun the launcher prints that line once for
    every rank (toolkit.train.rank_errors)."""
    import torch

    from toolkit.formats.hf_arch import HfConfigError
    from toolkit.plan.validate import ValidationError
    from toolkit.train import rank_errors
    from toolkit.train.checkpoint import ResumeError
    from toolkit.train.checkpoint_space import CheckpointSpaceError

    try:
        run(cfg, run_dir)
    except ValidationError as error:  # e.g. a package this node lacks
        rank_errors.known(str(error))
        return 2
    except (FloatingPointError, HfConfigError, ResumeError, CheckpointSpaceError) as error:  # what and the fix
        rank_errors.known(str(error))
        return 1
    except torch.OutOfMemoryError as error:  # what held the memory, the planner's terms and a fix
        rank_errors.known(oom.report(cfg, run_dir, error))
        return 1
    return 0
