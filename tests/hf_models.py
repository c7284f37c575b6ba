"""Tiny Hugging Face models of each family parakit reads (seeded, random weights, saved with
save_pretrained): GQA with fewer KV heads than heads, a vocabulary that is not a multiple of 128,
non-trivial biases and norm weights (transformers initialises those to 0 and 1, which would hide
a bias or norm that a conversion drops or misplaces)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 1100  # not a multiple of 128: padded to 1152 at tp=1, to 1280 at tp=2
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,  # pp=2 x vpp=2 splits it
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
CONFIGS = {
    "llama": ("LlamaConfig", dict(COMMON, tie_word_embeddings=False, rope_parameters={"rope_theta": 10000.0})),
    # Qwen2: biases on q, k, v; tied embeddings (as Qwen2.5-0.5B); another RoPE base.
    "qwen2": ("Qwen2Config", dict(COMMON, tie_word_embeddings=True, rope_parameters={"rope_theta": 1e6})),
    # Mistral: one KV head, head_dim other than hidden / heads (as Mistral-Nemo), and a sliding window
    # shorter than the test's 16 tokens (megatron-core's window of N-1 past tokens; N gave 0.64 off).
    "mistral": (
        "MistralConfig",
        dict(COMMON, num_key_value_heads=1, head_dim=24, sliding_window=8, tie_word_embeddings=False),
    ),
    # Qwen3: RMSNorm over each head's queries and keys; no q/k/v biases.
    "qwen3": ("Qwen3Config", dict(COMMON, head_dim=16, tie_word_embeddings=False)),
    # Mixtral: 4 experts of another FFN size than the attention's width, top-2, renormalised.
    "mixtral": ("MixtralConfig", dict(COMMON, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    # Qwen3-MoE: QK norms, 4 experts of moe_intermediate_size, top-2 renormalised, and layer 1 dense
    # (mlp_only_layers: the dense MLP of intermediate_size).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            COMMON,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    # Qwen2-MoE: q/k/v biases, 4 experts of moe_intermediate_size, top-2 NOT renormalised, a gated
    # shared expert of yet another size, and layer 2 dense.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            COMMON,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            norm_topk_prob=False,
            mlp_only_layers=[2],
            tie_word_embeddings=False,
        ),
    ),
    # GPT-2: learned positions, LayerNorm with biases, gelu_new, tied embeddings.
    "gpt2": (
        "GPT2Config",
        dict(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0),
    ),
}


def make_model(family: str, directory: Path, seed: int = 0):
    """Save a tiny random `family` model into `directory`; returns the transformers model (fp32)."""
    import torch
    import transformers

    class_name, kwargs = CONFIGS[family]
    config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = param.dim() == 1 and ("norm" in name or ".ln_" in name)
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if is_norm else 0.08 * torch.randn_like(param))
    model.eval()
    model.save_pretrained(directory)
    return model
