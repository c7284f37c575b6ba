"""Exact parameter counts: whole model, per pipeline stage, per tensor-parallel shard.

Counts follow megatron-core's GPTModel with the local layer spec (the same shapes as the
Transformer Engine spec): per layer a fused QKV ColumnParallelLinear, an output RowParallelLinear,
an MLP fc1 (2 x ffn for SwiGLU) and fc2, and two norms. Column-parallel weights and biases split
by tp; row-parallel weights split by tp while their biases and the norms are replicated on every
tensor-parallel rank. The embedding (padded vocabulary / tp rows, plus learned positions) lives on
the first stage, the final norm and output layer on the last; with tied embeddings and pp > 1 the
last stage holds its own copy of the embedding as the output layer (megatron-core
`LanguageModule.setup_embeddings_and_output_layer`).

`hf_model_params` counts the Hugging Face transformers model of the same config (unpadded vocab,
no sharding).
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.config.schema import ModelConfig, head_dim, kv_heads


def _norm(m: ModelConfig) -> int:
    return m.hidden_size * (2 if m.normalization == "LayerNorm" else 1)  # LayerNorm has a bias


def layer_params(m: ModelConfig, tp: int = 1) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank."""
    h, d = m.hidden_size, head_dim(m)
    q = m.num_attention_heads * d // tp
    # The fused QKV projection is one ColumnParallelLinear: its whole output splits by tp (also
    # when tp > KV heads, where megatron-core shares each KV head's projection across ranks).
    qkv_out = (m.num_attention_heads + 2 * kv_heads(m)) * d // tp
    qkv = h * qkv_out + (qkv_out if m.add_bias_linear or m.add_qkv_bias else 0)
    proj = q * h + (h if m.add_bias_linear else 0)
    fc1_out = m.ffn_hidden_size * (2 if m.activation == "swiglu" else 1) // tp
    fc1 = h * fc1_out + (fc1_out if m.add_bias_linear else 0)
    fc2 = (m.ffn_hidden_size // tp) * h + (h if m.add_bias_linear else 0)
    return qkv + proj + fc1 + fc2 + 2 * _norm(m)


def embedding_params(m: ModelConfig, padded_vocab: int, tp: int = 1) -> int:
    positions = m.max_position_embeddings * m.hidden_size if m.position_embedding == "learned_absolute" else 0
    return padded_vocab // tp * m.hidden_size + positions


def output_params(m: ModelConfig, padded_vocab: int, tp: int = 1, pp: int = 1) -> int:
    """The output layer; shares the embedding's weight only when both sit on the same stage."""
    if m.tie_embeddings and pp == 1:
        return 0
    return padded_vocab // tp * m.hidden_size


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one rank at pipeline stage `stage` (all its virtual chunks)."""

    stage: int
    layers: int
    embedding: int
    transformer: int
    final_norm: int
    output: int

    @property
    def total(self) -> int:
        return self.embedding + self.transformer + self.final_norm + self.output


def stage_params(
    m: ModelConfig, padded_vocab: int, tp: int = 1, pp: int = 1, stage: int = 0, layers: int | None = None
) -> StageParams:
    """One rank's parameters at pipeline `stage`, holding `layers` transformer layers (default:
    an even split). Virtual chunks change which layers a rank holds, not how many."""
    first, last = stage == 0, stage == pp - 1
    layers = m.num_layers // pp if layers is None else layers
    return StageParams(
        stage=stage,
        layers=layers,
        embedding=embedding_params(m, padded_vocab, tp) if first else 0,
        transformer=layers * layer_params(m, tp),
        final_norm=_norm(m) if last else 0,
        output=output_params(m, padded_vocab, tp, pp) if last else 0,
    )


def all_stage_params(
    m: ModelConfig, padded_vocab: int, tp: int = 1, pp: int = 1, stage_layers: tuple[int, ...] | None = None
) -> list[StageParams]:
    layers = stage_layers or (m.num_layers // pp,) * pp
    return [stage_params(m, padded_vocab, tp, pp, s, layers[s]) for s in range(pp)]


def model_params(m: ModelConfig, vocab: int | None = None) -> int:
    """Unique parameters of the whole model (tied embeddings counted once)."""
    vocab = m.vocab_size if vocab is None else vocab
    return embedding_params(m, vocab) + m.num_layers * layer_params(m) + _norm(m) + output_params(m, vocab)


def hf_model_params(m: ModelConfig) -> int:
    """The transformers model of this config: unpadded vocabulary, one copy of tied weights."""
    return model_params(m, m.vocab_size)
