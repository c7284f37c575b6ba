"""The eager-kernel figures the planner holds as constants are what PyTorch runs: the bytes the
element-wise kernels of a transformers Llama layer move (each operation's inputs and outputs, on
the meta device at two shapes and both activation dtypes), the activations autograd keeps for its
backward (saved_tensors_hooks), and the operations each backend's training loop dispatches per
layer and micro-batch and per optimizer step (counted on one CPU rank at two depths)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from training_runs import python

from toolkit.config.store import compose_config
from toolkit.plan.backends import BACKENDS
from toolkit.plan.kernels import eager_layer_bytes
from toolkit.plan.memory import layer_activation_bytes

# No data moved: views, and the attention kernel and GEMMs (priced on their own).
NO_KERNEL = {"view", "t", "transpose", "unsqueeze", "expand", "slice", "detach", "reshape", "_unsafe_view"}
NO_KERNEL |= {"split", "select", "alias", "permute", "squeeze", "as_strided", "split_with_sizes", "unbind"}
NO_KERNEL |= {"empty", "new_empty", "empty_like", "mm", "addmm", "bmm", "ones_like"}


class _Bytes(TorchDispatchMode):
    """Bytes read and written by every operation that moves data."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in NO_KERNEL:
            leaves = torch.utils._pytree.tree_leaves((args, kwargs, out))
            self.bytes += sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        return out


class _Attention(torch.autograd.Function):
    """Stands in for SDPA: the attention kernel is priced apart from the element-wise passes."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.shapes = (q, k, v)
        return q.new_empty(q.shape)

    @staticmethod
    def backward(ctx, grad):
        return tuple(t.new_empty(t.shape) for t in ctx.shapes)


def _llama_layer(h, ffn, heads, kv_heads, dtype, device):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(
        hidden_size=h, intermediate_size=ffn, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64
    )
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return LlamaDecoderLayer(config, 0).to(dtype)


def _run(layer, tokens, h, dtype, device):
    batch, seq = 2, tokens // 2
    with torch.device(device):
        x = torch.randn(batch, seq, h, dtype=dtype, requires_grad=True)
        cos, sin = torch.randn(1, seq, 64, dtype=dtype), torch.randn(1, seq, 64, dtype=dtype)
    out = layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=torch.arange(seq)[None])
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out))
    return x, cos, sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2048, 8192, 32, 8), (1024, 2816, 16, 4)])
def test_eager_layer_bytes_are_what_the_transformers_layer_moves(monkeypatch, dtype, shape):
    import transformers.integrations.sdpa_attention as sdpa

    monkeypatch.setattr(
        sdpa.torch.nn.functional, "scaled_dot_product_attention", lambda q, k, v, **_: _Attention.apply(q, k, v)
    )
    h, ffn, heads, kv_heads = shape
    tokens = 4096
    layer = _llama_layer(h, ffn, heads, kv_heads, dtype, "meta")
    counted = _Bytes()
    with counted:
        _run(layer, tokens, h, dtype, "meta")
    nbytes = torch.finfo(dtype).bits // 8
    planned = eager_layer_bytes(tokens, tokens * h, tokens * ffn, tokens * (heads + kv_heads) * 64, nbytes)
    assert planned == pytest.approx(counted.bytes, rel=1e-3)


def test_eager_activations_are_what_autograd_keeps():
    """What the transformers layer saves for its backward (the layer's input included, the weights
    and the rotary tables not) against the planner's eager activation count (flash attention keeps
    the output and the log-sum-exp, as the CPU's SDPA kernel does)."""
    h, ffn, heads, kv_heads, tokens = 512, 2048, 8, 2, 256
    layer = _llama_layer(h, ffn, heads, kv_heads, torch.bfloat16, "cpu")
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x, cos, sin = _run(layer, tokens, h, torch.bfloat16, "cpu")
    outside = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    outside |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    kept = sum(n for ptr, n in saved.items() if ptr not in outside)
    m = compose_config(
        ["model=llama3_1b", f"model.hidden_size={h}", f"model.ffn_hidden_size={ffn}"]
        + [f"model.num_attention_heads={heads}", f"model.num_kv_heads={kv_heads}"]
    ).model
    planned = layer_activation_bytes(m, 2, tokens // 2, 1, False, 2, flash=True, eager=True)
    fused = layer_activation_bytes(m, 2, tokens // 2, 1, False, 2, flash=True, eager=False)
    assert planned == pytest.approx(kept, rel=0.03)
    assert fused < 0.8 * kept  # the fused count alone would miss the norms' upcasts and silu's output


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_training_loop_dispatches_per_layer_and_step(tmp_path, backend):
    """The operations one rank's training loop dispatches inside its forward/backward spans (per
    layer and micro-batch: the layer, its gradient hooks) and outside them (per optimizer step: the
    update, the gradient norm, the loop's bookkeeping), at 2 and 4 layers, against the backend's
    description (within 10%: the counts are of CPU runs, the GPU's may differ in a few casts)."""
    script = Path(__file__).parent / "dist" / "count_dispatches.py"
    done = subprocess.run([python(), str(script), backend, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    description = BACKENDS[backend]
    per_layer = (counts[4]["per_microbatch"] - counts[2]["per_microbatch"]) / 2
    step_per_layer = (counts[4]["per_step"] - counts[2]["per_step"]) / 2
    assert per_layer == pytest.approx(description.layer_dispatches, rel=0.1)
    assert step_per_layer == pytest.approx(description.step_dispatches_per_layer, rel=0.1, abs=5)
    assert counts[2]["per_step"] - 2 * step_per_layer == pytest.approx(description.step_dispatches, rel=0.1, abs=10)
