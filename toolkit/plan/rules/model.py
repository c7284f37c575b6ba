"""The model's own shape: heads, GQA groups, sequence length, RoPE scaling."""

from __future__ import annotations

from typing import Iterator

from toolkit.config.schema import Config
from toolkit.plan.rules.base import Violation, divisors, err, listing


def shape(cfg: Config) -> Iterator[Violation]:
    m = cfg.model
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        yield err(
            "head_dim",
            {"model.hidden_size": m.hidden_size, "model.num_attention_heads": m.num_attention_heads},
            "hidden size is not divisible by the number of heads",
            f"use heads in {{{listing(divisors(m.hidden_size))}}} or set model.head_dim",
        )
    kv = m.num_kv_heads or m.num_attention_heads
    if m.num_attention_heads % kv:
        yield err(
            "kv_heads",
            {"model.num_attention_heads": m.num_attention_heads, "model.num_kv_heads": kv},
            "each KV head must serve the same number of query heads (GQA groups)",
            f"use model.num_kv_heads in {{{listing(divisors(m.num_attention_heads))}}}",
        )
    if m.seq_length > m.max_position_embeddings:
        yield err(
            "seq_length",
            {"model.seq_length": m.seq_length, "model.max_position_embeddings": m.max_position_embeddings},
            "training sequences are longer than the model supports",
            f"set model.seq_length<={m.max_position_embeddings} (or raise max_position_embeddings for a new model)",
        )


def rope(cfg: Config) -> Iterator[Violation]:
    """llama3 RoPE scaling's parameters (transformers `_validate_llama3_rope_parameters` warns about the
    same bounds; here they are errors, since a run with them trains a different model than intended)."""
    m, rs = cfg.model, cfg.model.rope_scaling
    if rs.type == "none":
        return
    if m.position_embedding != "rope":
        yield err(
            "rope_scaling_position",
            {"model.rope_scaling.type": rs.type, "model.position_embedding": m.position_embedding},
            "RoPE scaling stretches rotary position embeddings, which this model does not use",
            "set model.rope_scaling.type=none, or model.position_embedding=rope",
        )
    if rs.factor < 1:
        yield err(
            "rope_scaling",
            {"model.rope_scaling.factor": rs.factor},
            "llama3 scaling slows the low frequencies down by the factor, which must be >= 1",
            "set model.rope_scaling.factor>=1 (8 for Llama 3.1, 32 for Llama 3.2 1B)",
        )
    if not 0 < rs.low_freq_factor < rs.high_freq_factor:
        yield err(
            "rope_scaling",
            {
                "model.rope_scaling.low_freq_factor": rs.low_freq_factor,
                "model.rope_scaling.high_freq_factor": rs.high_freq_factor,
            },
            "the interpolated band lies between wavelengths L/high_freq_factor and L/low_freq_factor: "
            "it needs 0 < low_freq_factor < high_freq_factor",
            "set model.rope_scaling.low_freq_factor=1.0 and model.rope_scaling.high_freq_factor=4.0 (Llama 3.1)",
        )
    if not 0 < rs.original_max_position_embeddings < m.max_position_embeddings:
        yield err(
            "rope_scaling_context",
            {
                "model.rope_scaling.original_max_position_embeddings": rs.original_max_position_embeddings,
                "model.max_position_embeddings": m.max_position_embeddings,
            },
            "scaling extends the pretraining context (original_max_position_embeddings) to a longer "
            "max_position_embeddings",
            "set model.rope_scaling.original_max_position_embeddings to the context the model was pretrained at "
            f"(below {m.max_position_embeddings}; 8192 for Llama 3.1), or model.rope_scaling.type=none",
        )
