"""megatron-core GPTModel chunks for this rank, built from the emitted megatron.yaml sections.

parallel_state must be initialised first. With virtual pipeline stages a rank holds several
chunks (vp_stage 0..vpp-1); the embedding sits on the first chunk of the first stage and the
output layer on the last chunk of the last stage.
"""

from __future__ import annotations

import importlib.util

import torch

from toolkit.train.megatron_configs import build_megatron_configs


def layer_spec(transformer_config, sdpa: bool | None = None):
    """Transformer Engine's layer spec when TE is importable on a GPU; else megatron-core's local
    spec, with torch SDPA as core attention on a GPU (or when `sdpa` asks for it)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    on_gpu = torch.cuda.is_available()
    if on_gpu and importlib.util.find_spec("transformer_engine") is not None:
        return get_gpt_layer_with_transformer_engine_spec()
    spec = get_gpt_layer_local_spec(normalization=transformer_config.normalization)
    if sdpa if sdpa is not None else on_gpu:
        from toolkit.train.sdpa_attention import SdpaAttention

        spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    return spec


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
        chunks.append(
            GPTModel(
                config=transformer_config,
                transformer_layer_spec=spec,
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
        )
    return chunks
