"""Compatibility shims, on the ground floor: what must be in place before a dependency is imported,
by any floor (the data writer and the planner's tests import megatron-core as the trainer does)."""

from __future__ import annotations

import importlib.util
import sys
import types

# megatron-core 0.19.2 imports triton unconditionally in this one MoE kernel module (pulled in
# by megatron.core.distributed -> pipeline_parallel.schedules). A stub for that leaf only: a
# global fake `triton` would make torch._inductor believe triton exists and crash.
_TRITON_LEAF = "megatron.core.transformer.moe.ops.paged_stash"


def _kernel_unavailable(*_args, **_kwargs):
    raise RuntimeError("MoE paged stash kernels need triton and CUDA")


def import_shims() -> None:
    """Make `import megatron.core` work without triton. Call before importing megatron."""
    if importlib.util.find_spec("triton") is not None or _TRITON_LEAF in sys.modules:
        return
    stub = types.ModuleType(_TRITON_LEAF)
    stub.GLOBAL_BLOCK_SIZE = 1024
    stub.paged_stash_copy_kernel = _kernel_unavailable
    stub.paged_stash_pop_kernel = _kernel_unavailable
    sys.modules[_TRITON_LEAF] = stub
