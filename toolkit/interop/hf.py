"""The Hugging Face transformers config of a parakit model (same architecture, unpadded vocab)."""

from __future__ import annotations

from toolkit.config.schema import ModelConfig


def rope_parameters(m: ModelConfig) -> dict:
    """transformers' `rope_parameters` (v5; config.json's rope_theta + rope_scaling in v4): the keys
    `modeling_rope_utils._validate_llama3_rope_parameters` requires for llama3."""
    params = {"rope_type": "default", "rope_theta": m.rotary_base}
    rs = m.rope_scaling
    if rs.type == "llama3":
        params.update(
            rope_type="llama3",
            factor=rs.factor,
            low_freq_factor=rs.low_freq_factor,
            high_freq_factor=rs.high_freq_factor,
            original_max_position_embeddings=rs.original_max_position_embeddings,
        )
    return params


def hf_config(m: ModelConfig):
    """A transformers PretrainedConfig: LlamaConfig for the llama family, GPT2Config for gpt2."""
    if m.family == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=m.vocab_size,
            n_positions=m.max_position_embeddings,
            n_embd=m.hidden_size,
            n_layer=m.num_layers,
            n_head=m.num_attention_heads,
            n_inner=m.ffn_hidden_size,
            layer_norm_epsilon=m.norm_epsilon,
            resid_pdrop=m.hidden_dropout,
            embd_pdrop=m.hidden_dropout,
            attn_pdrop=m.attention_dropout,
            initializer_range=m.init_method_std,
            tie_word_embeddings=m.tie_embeddings,
            # exact (erf) GeLU as megatron-core's F.gelu, or GPT-2's own tanh approximation
            activation_function="gelu_new" if m.activation == "gelu_tanh" else "gelu",
        )
    common = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_kv_heads or m.num_attention_heads,
        head_dim=m.head_dim or m.hidden_size // m.num_attention_heads,
        max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.norm_epsilon,
        rope_parameters=rope_parameters(m),
        attention_dropout=m.attention_dropout,
        initializer_range=m.init_method_std,
        tie_word_embeddings=m.tie_embeddings,
    )
    if m.family == "qwen2":  # biases on q, k, v only
        from transformers import Qwen2Config

        return Qwen2Config(**common, use_sliding_window=False)
    if m.family == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**common, sliding_window=m.sliding_window)
    from transformers import LlamaConfig

    return LlamaConfig(**common, attention_bias=m.add_bias_linear, mlp_bias=m.add_bias_linear)


def check_hf_matches(m: ModelConfig, path: str) -> None:
    """Refuse a Hugging Face directory whose architecture differs from the configured model
    (read from its config.json by toolkit.formats.hf_arch, the same check as the megatron
    backend's; transformers' own defaults such as GPT-2's n_inner=None are understood there)."""
    from toolkit.formats.hf_arch import check_matches

    check_matches(m, path)
