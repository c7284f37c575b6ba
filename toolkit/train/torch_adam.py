"""megatron-core's distributed optimizer on torch's AdamW, which megatron-core falls back to without
Transformer Engine or apex (megatron/core/optimizer/__init__.py): on CPU, and on a GPU with a plain
CUDA torch. Resuming from a checkpoint needs three fixes there:
- torch's AdamW creates its states at the first step, but the load template is built from the
  states: a fresh optimizer gets zero states of the right shapes (`seed_states`);
- the checkpoint has no per-parameter 'step' for megatron-core to copy: loading tolerates it, and
  the dp_reshardable load must not copy the fresh optimizer's zero 'step' over the one the
  checkpoint's param_groups restored (it hands the state template's own tensors back for it);
- after a load all parameters would share one 'step' tensor, which torch then increments once
  per parameter (a wrong bias correction from the second resumed step): each gets its own.
"""

from __future__ import annotations

import torch


def runs_torch_adam() -> bool:
    """Whether megatron-core's Adam here is torch's AdamW (neither TE's nor apex's FusedAdam)."""
    from megatron.core import optimizer

    return optimizer.Adam is torch.optim.AdamW


def install_resume_fixes() -> None:
    """Patch megatron-core's DistributedOptimizer for torch's AdamW (idempotent)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if getattr(DistributedOptimizer, "_parakit_torch_adam", False):
        return
    set_states, load = DistributedOptimizer._set_main_param_and_optimizer_states, DistributedOptimizer.load_state_dict

    class _Missing(dict):
        def __missing__(self, key):
            return None

    def set_main_param_and_optimizer_states(self, main_param, tensors):
        return set_states(self, main_param, _Missing({k: v for k, v in tensors.items() if k != "step"}))

    def load_state_dict(self, state_dict):
        result = load(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return result

    DistributedOptimizer._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states
    DistributedOptimizer.load_state_dict = load_state_dict
    DistributedOptimizer._parakit_torch_adam = True


def seed_states(optimizer) -> None:
    """Zero AdamW states of the right shapes for a fresh optimizer, so that megatron-core can build
    the template a checkpoint loads into."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                state = inner.optimizer.state[param]
                if not state:
                    state.update(
                        step=torch.tensor(0.0), exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param)
                    )
