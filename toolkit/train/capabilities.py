"""What this machine runs: whether it imports the packages options need (toolkit.plan.backends'
`packages`), and which kernels a run ended up with (for its summary)."""

from __future__ import annotations

import importlib


def importable(module: str) -> bool:
    """Whether `module` imports here, as the run would import it: a package directory that fails to
    import (a build for another CUDA, a missing shared library) counts as absent, as it does for
    megatron-core's own HAVE_TE."""
    try:
        importlib.import_module(module)
    except Exception:  # ImportError, or OSError/RuntimeError from a broken native build
        return False
    return True


def qualified_name(cls: type) -> str:
    """e.g. "torch.optim.adamw.AdamW", "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"."""
    return f"{cls.__module__}.{cls.__qualname__}"
