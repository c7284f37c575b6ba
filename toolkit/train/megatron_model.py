"""megatron-core GPTModel chunks for this rank, built from the emitted megatron.yaml sections.

parallel_state must be initialised first. With virtual pipeline stages a rank holds several
chunks (vp_stage 0..vpp-1); the embedding sits on the first chunk of the first stage and the
output layer on the last chunk of the last stage.
"""

from __future__ import annotations

import torch

from toolkit.train.megatron_configs import build_megatron_configs


def have_transformer_engine() -> bool:
    """Whether megatron-core itself found a working Transformer Engine (its HAVE_TE: the import
    succeeded, not merely a package directory on the path)."""
    from toolkit.compat import import_shims

    import_shims()
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def initialize_tp_comm_overlap(config, seq_length: int, micro_batch: int) -> None:
    """Transformer Engine's userbuffers for config.tp_comm_overlap, before any layer runs: one
    micro-batch's tokens on this context-parallel rank by the hidden size, over the tensor-parallel
    ranks, bootstrapped over NCCL, as Megatron-LM's initialize._initialize_tp_communicators sets them
    up (TE 2.7 and later take quantization modes where earlier releases take use_fp8)."""
    import inspect

    from transformer_engine.pytorch import module as te_module

    initialize_ub = te_module.base.initialize_ub
    kwargs = {
        "shape": [seq_length * micro_batch // config.context_parallel_size, config.hidden_size],
        "tp_size": config.tensor_model_parallel_size,
    }
    parameters = inspect.signature(initialize_ub).parameters
    if "bootstrap_backend" in parameters:
        kwargs["bootstrap_backend"] = "nccl"  # Megatron-LM's --tp-comm-bootstrap-backend default
    if "quantization_modes" in parameters:
        modes = te_module.base.UserBufferQuantizationMode
        kwargs["quantization_modes"] = [modes.FP8 if config.fp8 else modes.NONE]
    else:
        kwargs["use_fp8"] = config.fp8 is not None
    initialize_ub(**kwargs)


def destroy_tp_comm_overlap() -> None:
    """Free the userbuffers initialize_tp_comm_overlap made."""
    from transformer_engine.pytorch import module as te_module

    te_module.base.destroy_ub()


class TorchNorm:
    """torch LayerNorm or RMSNorm (megatron-core's WrappedTorchNorm) that also runs under sequence
    parallel: its weights are marked `sequence_parallel`, as megatron-core's FusedLayerNorm marks
    them (fusions/fused_layer_norm.py), so finalize_model_grads sums their gradients over the
    tensor-parallel ranks, each of which saw only its share of the sequence."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norm_class = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_class(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def layer_spec(transformer_config, sdpa: bool | None = None):
    """The decoder layer's spec. Transformer Engine's when megatron-core has TE on a GPU (TE then
    runs context parallel as ring attention, sliding windows and fp8); else megatron-core's local
    spec, with torch norms that run under sequence parallel where apex's are absent, and torch
    SDPA as core attention (toolkit.train.sdpa_attention) on a GPU (unless train.attention_backend
    is unfused), for context parallel, or when `sdpa` asks for it."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    on_gpu = torch.cuda.is_available()
    if on_gpu and have_transformer_engine():
        return get_gpt_layer_with_transformer_engine_spec()
    spec = get_gpt_layer_local_spec(normalization=transformer_config.normalization)
    layer = spec.submodules
    if layer.input_layernorm is WrappedTorchNorm:  # no apex
        layer.input_layernorm = layer.pre_mlp_layernorm = TorchNorm
    if sdpa is None:  # megatron-core's local attention cannot split the sequence; SDPA is fused on GPUs
        fused = on_gpu and transformer_config.attention_backend != AttnBackend.unfused
        sdpa = fused or transformer_config.context_parallel_size > 1
    if sdpa:
        from toolkit.train.sdpa_attention import SdpaAttention

        layer.self_attention.submodules.core_attention = SdpaAttention
    return spec


def attention_kernel(spec) -> str:
    """The core attention a layer spec runs, for the run's summary."""
    core = getattr(spec.submodules.self_attention.submodules, "core_attention", None)
    return getattr(core, "__name__", str(core))


def _block_spec(transformer_config, layer, vp_stage):
    """The chunk's layers and its final norm. TransformerBlock takes megatron-core's own norm for a
    bare layer spec, which refuses sequence parallel without apex or TE: name the layer's."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if layer.submodules.input_layernorm is not TorchNorm:
        return layer
    count = get_num_layers_to_build(transformer_config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=TorchNorm)


def build_model_chunks(sections: dict, transformer_config=None, spec=None) -> list:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if transformer_config is None:
        transformer_config, _, _ = build_megatron_configs(sections)
    gpt = sections["gpt_model"]
    vpp = transformer_config.virtual_pipeline_model_parallel_size
    spec = spec or layer_spec(transformer_config)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = GPTModel(
            config=transformer_config,
            transformer_layer_spec=_block_spec(transformer_config, spec, stage),
            vocab_size=gpt["vocab_size"],
            max_sequence_length=gpt["max_sequence_length"],
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=gpt["parallel_output"],
            share_embeddings_and_output_weights=gpt["share_embeddings_and_output_weights"],
            position_embedding_type=gpt["position_embedding_type"],
            rotary_base=int(gpt["rotary_base"]),
            rope_scaling=gpt["rope_scaling"],
            rope_scaling_factor=gpt["rope_scaling_factor"],  # None (unused) without scaling
            vp_stage=stage,
        )
        if torch.cuda.is_available():
            # Megatron-LM's get_model moves every chunk to the GPU: modules that megatron-core does
            # not create on the device itself (torch norms, buffers) would stay on the host.
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    return chunks
