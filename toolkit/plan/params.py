"""Exact parameter counts: whole model, per pipeline stage, per tensor-parallel shard.

Counts follow megatron-core's GPTModel with the local layer spec (the same shapes as the
Transformer Engine spec): per layer a fused QKV ColumnParallelLinear, an output RowParallelLinear,
an MLP fc1 (2 x ffn for SwiGLU) and fc2, and two norms. Column-parallel weights and biases split
by tp; row-parallel weights split by tp while their biases and the norms are replicated on every
tensor-parallel rank. The embedding (padded vocabulary / tp rows, plus learned positions) lives on
the first stage, the final norm and output layer on the last; with tied embeddings and pp > 1 the
last stage holds its own copy of the embedding as the output layer (megatron-core
`LanguageModule.setup_embeddings_and_output_layer`).

A mixture-of-experts layer (megatron-core's MoELayer) keeps the attention and norms, and replaces
the MLP by a router (a replicated [experts, hidden] weight, TopKRouter), the experts (each an MLP
of the expert FFN size; experts / ep of them on a rank, each split by etp) and the optional shared
experts (split by tp like the dense MLP, with a [1, hidden] gate: SharedExpertMLP). The expert
weights are counted apart: their gradients reduce, and their optimizer states shard, over the
expert-data-parallel ranks instead of dp x cp.

`hf_model_params` counts the Hugging Face transformers model of the same config (unpadded vocab,
no sharding).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from toolkit.config.schema import ModelConfig, expert_ffn_size, head_dim, kv_heads, moe_layer_pattern
from toolkit.plan.memo import during_search


def _norm(m: ModelConfig) -> int:
    return m.hidden_size * (2 if m.normalization == "LayerNorm" else 1)  # LayerNorm has a bias


def _attention_params(m: ModelConfig, tp: int) -> int:
    """The attention block and the layer's two norms, on one tensor-parallel rank."""
    h, d = m.hidden_size, head_dim(m)
    q = m.num_attention_heads * d // tp
    # The fused QKV projection is one ColumnParallelLinear: its whole output splits by tp (also
    # when tp > KV heads, where megatron-core shares each KV head's projection across ranks).
    qkv_out = (m.num_attention_heads + 2 * kv_heads(m)) * d // tp
    qkv = h * qkv_out + (qkv_out if m.add_bias_linear or m.add_qkv_bias else 0)
    proj = q * h + (h if m.add_bias_linear else 0)
    qk_norms = 2 * d if m.qk_layernorm else 0  # one norm over a head's dimension, for queries and keys
    return qkv + proj + 2 * _norm(m) + qk_norms


def _mlp_params(m: ModelConfig, ffn: int, tp: int) -> int:
    """An MLP of FFN size `ffn` (fc1: 2 x ffn for SwiGLU; fc2), split over `tp` ranks."""
    h = m.hidden_size
    fc1_out = ffn * (2 if m.activation == "swiglu" else 1) // tp
    fc1 = h * fc1_out + (fc1_out if m.add_bias_linear else 0)
    fc2 = (ffn // tp) * h + (h if m.add_bias_linear else 0)
    return fc1 + fc2


def layer_params(m: ModelConfig, tp: int = 1) -> int:
    """Parameters of one dense transformer layer on one tensor-parallel rank."""
    return _attention_params(m, tp) + _mlp_params(m, m.ffn_hidden_size, tp)


def moe_layer_params(
    m: ModelConfig, tp: int = 1, ep: int = 1, etp: int | None = None, experts: int | None = None
) -> tuple[int, int]:
    """(the rest, the experts' weights) of one MoE layer on one rank: `experts` of the layer's
    experts (default: all of them) over ep ranks, each split etp ways (unset: tp, as megatron-core)."""
    h, moe = m.hidden_size, m.moe
    etp = tp if etp is None else etp
    experts = moe.num_experts if experts is None else experts
    router = moe.num_experts * h
    shared = _mlp_params(m, moe.shared_expert_size, tp) + h * moe.shared_expert_gate if moe.shared_expert_size else 0
    return _attention_params(m, tp) + router + shared, experts // ep * _mlp_params(m, expert_ffn_size(m), etp)


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
    transformer: int  # the layers' weights but the experts'
    final_norm: int
    output: int
    experts: int = 0  # the MoE layers' expert weights on this rank
    moe_layers: int = 0

    @functools.cached_property  # (the step's estimate reads them for every stage, often)
    def dense(self) -> int:
        """What reduces and shards over dp x cp (all but the experts)."""
        return self.embedding + self.transformer + self.final_norm + self.output

    @functools.cached_property
    def total(self) -> int:
        return self.dense + self.experts


def stage_layer_indices(num_layers: int, pp: int, vpp: int, stage_layers: tuple[int, ...], stage: int) -> list[int]:
    """The model's layers (0-based) on pipeline `stage`: a contiguous run without virtual stages;
    with them, chunk v of stage s is model chunk v*pp + s (megatron-core's interleaved order,
    transformer_block.get_transformer_layer_offset), each a stage's layers / vpp."""
    chunks = [(s, v) for v in range(vpp) for s in range(pp)]
    indices, start = [], 0
    for s, v in chunks:
        size = stage_layers[s] // vpp
        if s == stage:
            indices += range(start, start + size)
        start += size
    return indices


@during_search()
def stage_params(
    m: ModelConfig,
    padded_vocab: int,
    tp: int = 1,
    pp: int = 1,
    stage: int = 0,
    layers: int | None = None,
    moe_layers: int = 0,
    ep: int = 1,
    etp: int | None = None,
) -> StageParams:
    """One rank's parameters at pipeline `stage`, holding `layers` transformer layers (default:
    an even split), `moe_layers` of them MoE layers with their experts over ep x etp ranks.
    Virtual chunks change which layers a rank holds, not how many."""
    first, last = stage == 0, stage == pp - 1
    layers = m.num_layers // pp if layers is None else layers
    rest, experts = moe_layer_params(m, tp, ep, etp) if moe_layers else (0, 0)
    return StageParams(
        stage=stage,
        layers=layers,
        embedding=embedding_params(m, padded_vocab, tp) if first else 0,
        transformer=(layers - moe_layers) * layer_params(m, tp) + moe_layers * rest,
        final_norm=_norm(m) if last else 0,
        output=output_params(m, padded_vocab, tp, pp) if last else 0,
        experts=moe_layers * experts,
        moe_layers=moe_layers,
    )


@during_search()
def stage_moe_layers(m: ModelConfig, pp: int, vpp: int, stage_layers: tuple[int, ...], stage: int) -> int:
    pattern = moe_layer_pattern(m)
    return sum(pattern[i] for i in stage_layer_indices(m.num_layers, pp, vpp, stage_layers, stage))


def all_stage_params(
    m: ModelConfig,
    padded_vocab: int,
    tp: int = 1,
    pp: int = 1,
    stage_layers: tuple[int, ...] | None = None,
    vpp: int = 1,
    ep: int = 1,
    etp: int | None = None,
) -> list[StageParams]:
    return list(_all_stage_params(m, padded_vocab, tp, pp, stage_layers, vpp, ep, etp))


@during_search()
def _all_stage_params(m: ModelConfig, padded_vocab: int, tp, pp, stage_layers, vpp, ep, etp) -> tuple[StageParams, ...]:
    layers = stage_layers or (m.num_layers // pp,) * pp
    return tuple(
        stage_params(m, padded_vocab, tp, pp, s, layers[s], stage_moe_layers(m, pp, vpp, layers, s), ep, etp)
        for s in range(pp)
    )


@during_search(by_identity=2)
def layout_stage_params(m: ModelConfig, layout, stage: int) -> StageParams:
    """stage_params for a resolved layout (toolkit.plan.layout.Layout)."""
    d = layout.dims
    moe_layers = stage_moe_layers(m, d.pp, d.vpp, layout.stage_layers, stage)
    return stage_params(
        m, layout.padded_vocab_size, d.tp, d.pp, stage, layout.stage_layers[stage], moe_layers, d.ep, d.etp
    )


# Modules with parameters outside the layers: the embedding, the final norm and the output layer
# (tied or not, a module of its own).
OUTER_PARAMETER_MODULES = 3


def layer_parameter_modules(m: ModelConfig, moe: bool = False) -> int:
    """Modules holding parameters in one layer of the family's transformers model (what DeepSpeed
    ZeRO-3 fetches and releases one by one): the q, k, v and output projections, the MLP's linears
    (an MoE layer's router, each expert's and the shared expert's) and two norms."""
    mlp = 3 if m.activation == "swiglu" else 2
    if moe:
        mlp = 1 + m.moe.num_experts * mlp + (mlp if m.moe.shared_expert_size else 0)
    return 4 + mlp + 2


def model_params(m: ModelConfig, vocab: int | None = None, active: bool = False) -> int:
    """Unique parameters of the whole model (tied embeddings counted once); `active`: those one
    token passes through (router_topk experts of each MoE layer: what its FLOPs count)."""
    vocab = m.vocab_size if vocab is None else vocab
    moe_layers = sum(moe_layer_pattern(m))
    if moe_layers:
        rest, experts = moe_layer_params(m, experts=m.moe.router_topk if active else None)
        moe = moe_layers * (rest + experts)
    else:
        moe = 0
    dense = (m.num_layers - moe_layers) * layer_params(m)
    return embedding_params(m, vocab) + dense + moe + _norm(m) + output_params(m, vocab)


def hf_model_params(m: ModelConfig) -> int:
    """The transformers model of this config: unpadded vocabulary, one copy of tied weights."""
    return model_params(m, m.vocab_size)
