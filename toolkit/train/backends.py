"""Each backend's step functions (toolkit.train.loop.BackendSteps), by the name of its description
in toolkit.plan.backends: a module imported on first use, since each pulls in its own framework
(megatron-core, DeepSpeed) and a run needs one."""

from __future__ import annotations

import importlib
from types import ModuleType

TRAINERS = {
    "megatron": "toolkit.train.megatron_backend",
    "deepspeed": "toolkit.train.deepspeed_backend",
}


def trainer_module(backend: str) -> ModuleType:
    """The module whose setup(cfg, layout) returns `backend`'s BackendSteps."""
    if backend not in TRAINERS:
        raise ValueError(f"backend.name={backend}: no trainer for it; one of {sorted(TRAINERS)}")
    return importlib.import_module(TRAINERS[backend])
