"""Import upstream modules with torch.compile as the identity decorator, on the CPU.

megatron-core (its fused element-wise functions, megatron.core.jit.jit_fuser) and DeepSpeed (its
Muon optimizer, imported by the ZeRO optimizer check of every deepspeed.initialize) decorate
functions with torch.compile when they are imported, and torch.compile imports TorchDynamo and
Inductor: 1.5-2.5 s of every rank's start. parakit's CPU runs never call those functions
compiled, so they import them undecorated; on GPUs nothing changes.
"""

from __future__ import annotations

import importlib
import sys

import torch


def import_without_compiling(*modules: str) -> None:
    """Import `modules` (those not imported yet) with torch.compile as the identity, on the CPU."""
    missing = [m for m in modules if m not in sys.modules]
    if not missing or torch.cuda.is_available():
        return
    compile_ = torch.compile

    def identity(model=None, **options):
        return (lambda fn: fn) if model is None else model

    torch.compile = identity
    try:
        for module in missing:
            importlib.import_module(module)
    finally:
        torch.compile = compile_
