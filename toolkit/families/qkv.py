"""megatron-core's fused QKV layout, both ways: linear_qkv's rows are grouped by KV group,
[q heads of group 0, k of group 0, v of group 0, q heads of group 1, ...] (megatron/core/
transformer/attention.py, SelfAttention.get_query_key_value_tensors); Hugging Face models keep
[all q; all k; all v] (separate q/k/v projections, or GPT-2's one c_attn)."""

from __future__ import annotations

from toolkit.config.schema import ModelConfig, head_dim, kv_heads


def split_qkv(weight, m: ModelConfig):
    """linear_qkv's rows (or bias) -> q, k, v, each in head order."""
    groups, d = kv_heads(m), head_dim(m)
    per_group = m.num_attention_heads // groups
    w = weight.reshape(groups, per_group + 2, d, *weight.shape[1:])
    q = w[:, :per_group].reshape(m.num_attention_heads * d, *weight.shape[1:])
    k = w[:, per_group].reshape(groups * d, *weight.shape[1:])
    v = w[:, per_group + 1].reshape(groups * d, *weight.shape[1:])
    return q, k, v


def interleave_qkv(q, k, v, m: ModelConfig):
    """[all q; all k; all v] rows -> megatron-core's per-group [q..., k, v] rows (the inverse of
    split_qkv)."""
    import torch

    groups, d = kv_heads(m), head_dim(m)
    rest = q.shape[1:]
    q = q.reshape(groups, m.num_attention_heads // groups * d, *rest)
    k, v = k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)
