"""Core attention through torch's scaled_dot_product_attention for megatron-core's local spec,
with sliding windows and context parallel.

Without Transformer Engine, megatron-core's local DotProductAttention materialises the s x s
scores (baddbmm, softmax, bmm) and refuses context parallel. On a GPU, torch's SDPA dispatches to
FlashAttention or the memory-efficient kernel instead: no s^2 buffer, fused kernels. Same math
(causal mask, scale 1/sqrt(head_dim), grouped KV heads, megatron-core's (left, right) window),
so it can stand in for the local core attention.

Context parallel (cp > 1): each rank holds two of the sequence's 2*cp chunks (megatron-core's
load-balanced split, `get_batch_on_this_cp_rank`). K and V are all-gathered over the cp group
(the backward reduce-scatters their gradients) and every local query attends to the gathered
keys by their positions in the whole sequence: the all-gather context parallelism of Llama 3
(Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2). TE's ring attention does
the same on GPUs with Transformer Engine.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F

from toolkit.compat import import_shims

import_shims()
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.utils import is_layer_window_attention  # noqa: E402


def cp_positions(local_length: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Positions in the whole sequence of a cp rank's tokens: chunks cp_rank and 2*cp-1-cp_rank of
    the 2*cp equal chunks (megatron.core.utils._get_batch_on_this_cp_rank_per_sequence_balancing)."""
    chunk = local_length // 2
    starts = (cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def visible(query_positions: torch.Tensor, key_positions: torch.Tensor, window) -> torch.Tensor:
    """[sq, sk] True where the query may attend the key: causal, and within megatron-core's
    (left, right) window when there is one (transformer/utils.py get_sliding_window_causal_mask:
    key j is seen from query i when i - left <= j <= i + right)."""
    offset = query_positions[:, None] - key_positions[None, :]
    allowed = offset >= 0
    if window is not None:
        left, right = window
        allowed &= (offset <= left) & (offset >= -right)
    return allowed


class SdpaAttention(DotProductAttention):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args, **kwargs):
        # DotProductAttention refuses cp > 1 (Transformer Engine only); this class gathers K/V itself.
        local = copy.copy(config)
        local.context_parallel_size = 1
        super().__init__(local, layer_number, attn_mask_type, attention_type, *args, **kwargs)
        self.config = config
        self.window = (
            tuple(config.window_size)
            if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number)
            else None
        )
        self.cp_group = parallel_state.get_context_parallel_group() if config.context_parallel_size > 1 else None

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPA core attention supports neither packed sequences nor attention bias")
        mask_type = attn_mask_type or self.attn_mask_type
        if mask_type != AttnMaskType.causal or attention_mask is not None:
            raise NotImplementedError(f"SDPA core attention is causal only, got {mask_type} with a mask")
        mask = None
        if self.cp_group is not None:
            cp_size, cp_rank = self.cp_group.size(), self.cp_group.rank()
            query_positions = cp_positions(query.size(0), cp_rank, cp_size, query.device)
            key_positions = torch.cat([cp_positions(key.size(0), r, cp_size, key.device) for r in range(cp_size)])
            # [s_local, b, g, d] -> [cp * s_local, b, g, d], ranks in order; backward: reduce-scatter.
            key, value = (
                gather_from_sequence_parallel_region(t.contiguous(), True, self.cp_group) for t in (key, value)
            )
            mask = visible(query_positions, key_positions, self.window)
        elif self.window is not None:
            positions = torch.arange(query.size(0), device=query.device)
            mask = visible(positions, positions, self.window)
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        dropout = self.config.attention_dropout if self.training else 0.0
        # Each tensor-parallel rank drops out its own heads' probabilities: megatron-core's local
        # attention draws them from the model-parallel RNG outside sequence parallel.
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        with rng:
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=self.softmax_scale
            )
        # [b, heads, s, d] -> [s, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(context.size(2), context.size(0), self.hidden_size_per_partition)
