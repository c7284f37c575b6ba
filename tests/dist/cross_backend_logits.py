"""The logits of the megatron-core model (the run's config at tp = pp = 1, weights from a dist
checkpoint) and of the transformers model converted from the same weights, on the same tokens.

Prints {variant: largest absolute logit difference} as JSON for the faithful conversion and for
test-only defects of the converter or the config (mutations the product never makes): two query
heads swapped, SwiGLU's gate and up projections swapped, the final norm dropped, another RoPE
base, and for a mixture of experts two experts' weights traded under the same router.

    python cross_backend_logits.py PORT RUN_DIR MEGATRON_CHECKPOINT HF_DIR
"""

import copy
import json
import os
import sys
from pathlib import Path

import torch

from toolkit.train import mcore_cpu

mcore_cpu.enable()


def _swap_query_heads(state: dict, m) -> None:
    d = m.head_dim or m.hidden_size // m.num_attention_heads
    for i in range(m.num_layers):
        q = state[f"model.layers.{i}.self_attn.q_proj.weight"]
        q[:d], q[d : 2 * d] = q[d : 2 * d].clone(), q[:d].clone()


def _swap_gate_up(state: dict, m) -> None:
    for i in range(m.num_layers):
        gate, up = f"model.layers.{i}.mlp.gate_proj.weight", f"model.layers.{i}.mlp.up_proj.weight"
        if gate in state:
            state[gate], state[up] = state[up], state[gate]
        else:  # transformers' experts in memory: [experts, gate; up, hidden]
            fused = state[f"model.layers.{i}.mlp.experts.gate_up_proj"]
            gate_half, up_half = fused.chunk(2, dim=1)
            fused.copy_(torch.cat([up_half.clone(), gate_half.clone()], dim=1))


def _swap_experts(state: dict, m) -> None:
    """The first layer's experts 0 and 1 trade weights while the router keeps its rows."""
    for kind in ("gate_up_proj", "down_proj"):
        w = state[f"model.layers.0.mlp.experts.{kind}"]
        w[0], w[1] = w[1].clone(), w[0].clone()


def main():
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.emit.megatron import megatron_sections
    from toolkit.plan.layout import resolve
    from toolkit.config.store import load_run_config
    from toolkit.train.data import SyntheticTokens
    from toolkit.train.megatron_model import build_model_chunks

    port, run_dir, checkpoint, hf_dir = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    cfg = load_run_config(run_dir)
    model_parallel_cuda_manual_seed(cfg.train.seed)
    assert cfg.parallel.tp == cfg.parallel.pp == 1 and cfg.precision.dtype == "fp32"
    (megatron,) = build_model_chunks(megatron_sections(cfg, resolve(cfg)))
    megatron.load_state_dict(dist_checkpointing.load({"chunk0": megatron.sharded_state_dict()}, checkpoint)["chunk0"])
    megatron.eval()

    data = SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_length, seed=cfg.train.seed + 1)
    tokens = torch.stack([data[i]["tokens"] for i in range(2)])
    positions = torch.arange(cfg.model.seq_length).expand(2, -1)
    with torch.no_grad():
        expected = megatron(tokens, positions, None)[..., : cfg.model.vocab_size]

    config = AutoConfig.from_pretrained(hf_dir)
    faithful = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    state = faithful.state_dict()

    def variant(edit_state=None, edit_model=None, **config_changes):
        model = AutoModelForCausalLM.from_config(_with(config, config_changes), dtype=torch.float32)
        changed = {k: v.clone() for k, v in state.items()}
        if edit_state:
            edit_state(changed, cfg.model)
        model.load_state_dict(changed)
        if edit_model:
            edit_model(model)
        return model

    models = {
        "faithful": faithful,
        "swapped_query_heads": variant(edit_state=_swap_query_heads),
        "swapped_gate_up": variant(edit_state=_swap_gate_up),
        "no_final_norm": variant(edit_model=lambda model: setattr(model.model, "norm", torch.nn.Identity())),
        "rope_base_500000": variant(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    }
    if cfg.model.moe.num_experts:
        models["swapped_experts"] = variant(edit_state=_swap_experts)
    out = {}
    for name, model in models.items():
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=tokens, position_ids=positions).logits
        out[name] = (logits - expected).abs().max().item()
    print(json.dumps(out))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _with(config, changes: dict):
    changed = copy.deepcopy(config)
    for key, value in changes.items():
        setattr(changed, key, value)
    return changed


if __name__ == "__main__":
    main()
