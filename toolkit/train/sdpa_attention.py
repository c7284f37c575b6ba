"""Core attention through torch's scaled_dot_product_attention for megatron-core's local spec.

Without Transformer Engine, megatron-core's local DotProductAttention materialises the s x s
scores (baddbmm, softmax, bmm). On a GPU, torch's SDPA dispatches to FlashAttention or the
memory-efficient kernel instead: no s^2 buffer, fused kernels. Same math (causal mask, scale
1/sqrt(head_dim), grouped KV heads), so it can stand in for the local core attention.
"""

from __future__ import annotations

import torch.nn.functional as F

from toolkit.train import mcore_cpu

mcore_cpu.import_shims()
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402


class SdpaAttention(DotProductAttention):
    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPA core attention supports neither packed sequences nor attention bias")
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        mask = None if causal or attention_mask is None else ~attention_mask  # megatron masks True = hide
        dropout = self.config.attention_dropout if self.training else 0.0
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.softmax_scale
        )
        # [b, heads, s, d] -> [s, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(context.size(2), context.size(0), self.hidden_size_per_partition)
