"""The routers' losses of a transformers mixture-of-experts model, computed per MoE layer and
micro-batch as megatron-core computes them (transformer/moe/router.py: _apply_aux_loss,
_apply_seq_aux_loss, apply_z_loss; moe_utils.py: switch_load_balancing_loss_func, z_loss_func),
so that the deepspeed backend trains the objective the megatron backend trains, from the router
logits transformers returns (output_router_logits).

Per layer, with T tokens, E experts, top-k routing, scores s = softmax(logits) over all experts
and f_e the number of tokens whose top-k scores include expert e:
  load balancing  coeff * E / (k T^2) * sum_e f_e * sum_t s_te   (Fedus et al. 2021, "Switch
                  Transformers", eq. 4); seq_aux_loss: the same over each sequence, averaged
  z-loss          coeff * mean_t logsumexp(logits_t)^2          (Zoph et al. 2022, "ST-MoE", eq. 5)
Both are added to the loss layer by layer. transformers' own load_balancing_loss_func
(modeling_mixtral.py) concatenates all layers' tokens before taking the product of the two
means: another objective, so it is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.config.schema import MoeConfig


@dataclass
class RouterLosses:
    """One micro-batch's router losses: what the loss gains, and what is logged (each loss without
    its coefficient, averaged over the MoE layers, as megatron-core's MoE metrics tracker reports)."""

    total: torch.Tensor
    logged: dict[str, torch.Tensor]


def logged_names(moe: MoeConfig) -> list[str]:
    """The losses a run with these routers logs (megatron-core's tracker records those it computes)."""
    names = ["moe_aux_loss"] if moe.load_balancing in ("aux_loss", "seq_aux_loss") and moe.aux_loss_coeff else []
    return names + (["moe_z_loss"] if moe.z_loss_coeff else [])


def _balancing(scores: torch.Tensor, topk: int, coeff: float) -> torch.Tensor:
    """The load-balancing loss of one group of tokens: scores [T, E] in fp32."""
    tokens, experts = scores.shape
    chosen = torch.topk(scores, topk, dim=-1).indices
    tokens_per_expert = torch.zeros(experts, device=scores.device).index_add_(
        0, chosen.reshape(-1), torch.ones(chosen.numel(), device=scores.device)
    )
    return torch.sum(scores.sum(dim=0) * tokens_per_expert) * (experts * coeff / (topk * tokens * tokens))


def router_losses(router_logits: tuple[torch.Tensor, ...], moe: MoeConfig, sequences: int) -> RouterLosses:
    """The losses of the MoE layers' router logits (each [sequences x seq, experts], the tokens of
    one micro-batch sequence by sequence, as transformers flattens them)."""
    names = logged_names(moe)
    total = torch.zeros((), device=router_logits[0].device)
    logged = {name: torch.zeros((), device=total.device) for name in names}
    for logits in router_logits:
        logits = logits.float()  # megatron-core's moe_router_dtype=fp32
        if "moe_aux_loss" in logged:
            scores = torch.softmax(logits, dim=-1)
            if moe.load_balancing == "aux_loss":
                aux = _balancing(scores, moe.router_topk, moe.aux_loss_coeff)
            else:
                per_sequence = scores.reshape(sequences, -1, scores.size(-1))
                aux = sum(_balancing(s, moe.router_topk, moe.aux_loss_coeff) for s in per_sequence) / sequences
            total = total + aux
            logged["moe_aux_loss"] += aux.detach() / moe.aux_loss_coeff
        if "moe_z_loss" in logged:
            z = torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * moe.z_loss_coeff
            total = total + z
            logged["moe_z_loss"] += z.detach() / moe.z_loss_coeff
    return RouterLosses(total, {name: value / len(router_logits) for name, value in logged.items()})
