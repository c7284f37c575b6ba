"""FLOPs of a training step: model FLOPs (what MFU counts) and hardware FLOPs (with recompute).

Per token and layer, every GEMM costs 2 FLOPs per multiply-add, 3 times (forward, backward
data-gradient, backward weight-gradient): Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", section 5.1 / Appendix, generalised to GQA and
SwiGLU as in Megatron-LM `megatron/training/training.py::num_floating_point_operations`:
  projections  6 * h * (q + 2 kv)  +  6 * q * h
  MLP          6 * h * ffn * (3 if SwiGLU else 2)
  attention    6 * 2 * s * q, halved for the causal mask (only half the scores are non-zero;
               Megatron-LM counts it so; PaLM's 6N + 12LHQT, Chowdhery et al. 2022 App. B,
               does not halve: `causal=False` reproduces that convention)
  logits       6 * h * V
  MoE layers   the MLP term for router_topk experts of the expert FFN size and the shared experts,
               plus the router's 6 * h * experts (Megatron-LM's num_floating_point_operations)
Hardware FLOPs add the recomputed forward passes: full recompute re-runs each layer's forward
(+1/3 of its FLOPs, Narayanan et al. 2021 eq. 3: 96 instead of 72 B s L h^2); selective
recompute re-runs only the attention core (Korthikanti et al. 2022, section 5).
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.config.schema import ModelConfig, expert_ffn_size, head_dim, kv_heads, moe_layer_pattern


def _forward_per_token(m: ModelConfig, seq_length: int, vocab: int, causal: bool) -> tuple[float, float, float]:
    """Forward FLOPs per token: (layer GEMMs, attention core, logits), all layers."""
    h, d = m.hidden_size, head_dim(m)
    q, kv = m.num_attention_heads * d, kv_heads(m) * d
    matrices = 3 if m.activation == "swiglu" else 2
    attention = 2 * (h * (q + 2 * kv) + q * h)
    dense_mlp = 2 * h * m.ffn_hidden_size * matrices
    moe_layers = sum(moe_layer_pattern(m))
    moe_mlp = 0.0
    if moe_layers:
        moe = m.moe
        routed = moe.router_topk * expert_ffn_size(m) + (moe.shared_expert_size or 0)
        moe_mlp = 2 * h * routed * matrices + 2 * h * moe.num_experts
    gemm = m.num_layers * attention + (m.num_layers - moe_layers) * dense_mlp + moe_layers * moe_mlp
    core = 2 * 2 * seq_length * q * (0.5 if causal else 1.0)  # QK^T and softmax(.)V
    return gemm, m.num_layers * core, 2 * h * vocab


@dataclass(frozen=True)
class StepFlops:
    model: float  # model FLOPs per step (MFU's numerator)
    hardware: float  # including recomputation (HFU's numerator)
    tokens: int  # tokens per step

    @property
    def model_per_token(self) -> float:
        return self.model / self.tokens


def step_flops(
    m: ModelConfig,
    seq_length: int,
    global_batch: int,
    recompute: str = "none",
    vocab: int | None = None,
    causal: bool = True,
) -> StepFlops:
    gemm, core, logits = _forward_per_token(m, seq_length, vocab or m.vocab_size, causal)
    tokens = global_batch * seq_length
    model = 3 * (gemm + core + logits) * tokens
    extra = {"none": 0.0, "selective": core, "full": gemm + core}[recompute]
    return StepFlops(model=model, hardware=model + extra * tokens, tokens=tokens)
