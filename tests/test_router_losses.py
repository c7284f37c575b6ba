"""The routers' losses the deepspeed backend adds (toolkit.train.router_losses) are megatron-core's:
computed here with megatron-core's own functions the way its router calls them
(transformer/moe/router.py _apply_aux_loss, _apply_seq_aux_loss, apply_z_loss), on the same
logits laid out as megatron-core holds them ([sequence, batch] where transformers flattens
[batch, sequence]). transformers' own load_balancing_loss_func is another objective (it pools
every layer's tokens and does not divide by the top-k), which is why parakit computes its own."""

import dataclasses

import pytest
import torch

from toolkit.compat import import_shims
from toolkit.config.schema import MoeConfig
from toolkit.train.router_losses import router_losses

import_shims()
from megatron.core.transformer.moe.moe_utils import (  # noqa: E402
    compute_routing_scores_for_aux_loss,
    switch_load_balancing_loss_func,
    z_loss_func,
)

SEQUENCES, SEQ, EXPERTS, TOPK, LAYERS = 3, 16, 4, 2, 2
MOE = MoeConfig(num_experts=EXPERTS, router_topk=TOPK, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
# Both sides compute in fp32 from the same logits, summing in other orders: 1e-6 relative is
# float32 rounding; the sequence-level loss differs from the micro-batch one by 1.4% on these
# logits, transformers' pooled one by 98%.
RELATIVE = 1e-6


@pytest.fixture(scope="module")
def logits():
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(SEQUENCES * SEQ, EXPERTS, generator=generator) for _ in range(LAYERS))


def megatron_order(layer: torch.Tensor) -> torch.Tensor:
    """transformers' [batch x sequence] tokens in megatron-core's [sequence x batch] order."""
    return layer.reshape(SEQUENCES, SEQ, EXPERTS).transpose(0, 1).reshape(-1, EXPERTS)


def megatron_aux(layer: torch.Tensor, coeff: float) -> torch.Tensor:
    routing_map, scores = compute_routing_scores_for_aux_loss(megatron_order(layer), TOPK, "softmax")
    return switch_load_balancing_loss_func(scores, routing_map.sum(dim=0), scores.shape[0], TOPK, EXPERTS, coeff)


def megatron_seq_aux(layer: torch.Tensor, coeff: float) -> torch.Tensor:
    routing_map, scores = compute_routing_scores_for_aux_loss(megatron_order(layer), TOPK, "softmax")
    scores, routing_map = scores.reshape(SEQ, -1), routing_map.reshape(SEQ, -1)
    loss = switch_load_balancing_loss_func(scores, routing_map.sum(dim=0), SEQ, TOPK, EXPERTS, coeff)
    return loss / SEQUENCES


@pytest.mark.parametrize(("balancing", "reference"), [("aux_loss", megatron_aux), ("seq_aux_loss", megatron_seq_aux)])
def test_losses_are_megatron_cores(logits, balancing, reference):
    moe = dataclasses.replace(MOE, load_balancing=balancing)
    ours = router_losses(logits, moe, SEQUENCES)
    aux = [reference(layer, moe.aux_loss_coeff) for layer in logits]
    z = [z_loss_func(megatron_order(layer), moe.z_loss_coeff) for layer in logits]
    assert ours.total.item() == pytest.approx(sum(aux).item() + sum(z).item(), rel=RELATIVE)
    # logged as megatron-core's tracker reports them: without the coefficient, mean over the layers
    assert ours.logged["moe_aux_loss"].item() == pytest.approx(sum(aux).item() / LAYERS / 1e-2, rel=RELATIVE)
    assert ours.logged["moe_z_loss"].item() == pytest.approx(sum(z).item() / LAYERS / 1e-3, rel=RELATIVE)


def test_only_the_configured_losses_are_added_and_logged(logits):
    none = router_losses(logits, dataclasses.replace(MOE, load_balancing="none", z_loss_coeff=None), SEQUENCES)
    assert none.total.item() == 0.0 and none.logged == {}
    no_z = router_losses(logits, dataclasses.replace(MOE, z_loss_coeff=None), SEQUENCES)
    assert set(no_z.logged) == {"moe_aux_loss"}


def test_transformers_pooled_loss_is_another_objective(logits):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    pooled = load_balancing_loss_func(logits, EXPERTS, TOPK).item()
    ours = router_losses(logits, dataclasses.replace(MOE, z_loss_coeff=None), SEQUENCES).logged["moe_aux_loss"]
    # ours is the mean over layers, about 1 at even load; transformers' pools the layers' tokens
    # and counts each token top-k times: about 2 here
    assert pooled == pytest.approx(TOPK * ours.item(), rel=0.05) and abs(pooled - ours.item()) > 0.5
