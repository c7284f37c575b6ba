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


def layer_spec(transformer_config, sdpa: bool | None = None, num_experts: int | None = None):
    """The decoder layer's spec. Transformer Engine's when megatron-core has TE on a GPU (TE then
    runs context parallel as ring attention, sliding windows and fp8); else megatron-core's local
    spec, with torch norms that run under sequence parallel where apex's are absent, and torch
    SDPA as core attention (toolkit.train.sdpa_attention) on a GPU (unless train.attention_backend
    is unfused), for context parallel, or when `sdpa` asks for it. `num_experts`: a mixture-of-experts
    layer's (megatron-core's MoELayer; sequential experts without grouped GEMM)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    on_gpu = torch.cuda.is_available()
    layer = {
        "num_experts": num_experts,
        "moe_grouped_gemm": bool(num_experts) and transformer_config.moe_grouped_gemm,
        "qk_layernorm": transformer_config.qk_layernorm,
    }
    if on_gpu and have_transformer_engine():
        return get_gpt_layer_with_transformer_engine_spec(**layer)
    spec = get_gpt_layer_local_spec(normalization=transformer_config.normalization, **layer)
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


def decoder_layer_specs(transformer_config, spec=None) -> list:
    """One spec per layer of the model: `spec` (default layer_spec's) for the dense layers and its
    mixture-of-experts twin where megatron-core's moe_layer_freq (a list, as emitted) says so."""
    dense = spec or layer_spec(transformer_config)
    if not transformer_config.num_moe_experts:
        return [dense] * transformer_config.num_layers
    moe = layer_spec(transformer_config, num_experts=transformer_config.num_moe_experts)
    return [moe if is_moe else dense for is_moe in transformer_config.moe_layer_freq]


def _block_spec(transformer_config, specs: list, vp_stage):
    """The chunk's layers and its final norm, sliced from the model's layer specs as megatron-core's
    get_gpt_decoder_block_spec does. A bare layer spec (one kind of layer, megatron-core's own
    norms) lets TransformerBlock build them; it would take megatron-core's norm for the final one,
    which refuses sequence parallel without apex or TE: name the layers' own."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
        get_transformer_layer_offset,
    )

    norm = specs[0].submodules.input_layernorm
    if norm is not TorchNorm and all(s is specs[0] for s in specs):
        return specs[0]
    if norm is IdentityOp:  # Transformer Engine's spec fuses it into the QKV projection
        from megatron.core.extensions.transformer_engine import TENorm

        norm = TENorm
    offset = get_transformer_layer_offset(transformer_config, vp_stage=vp_stage)
    count = get_num_layers_to_build(transformer_config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=specs[offset : offset + count], layer_norm=norm)


def build_model_chunks(sections: dict, transformer_config=None, spec=None) -> list:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if transformer_config is None:
        transformer_config, _, _ = build_megatron_configs(sections)
    gpt = sections["gpt_model"]
    vpp = transformer_config.virtual_pipeline_model_parallel_size
    specs = decoder_layer_specs(transformer_config, spec)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = GPTModel(
            config=transformer_config,
            transformer_layer_spec=_block_spec(transformer_config, specs, stage),
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
