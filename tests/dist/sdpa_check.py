"""Build the tiny model with megatron-core's local core attention and with torch SDPA, same
weights; print the losses, the largest gradient difference and the causality check as JSON."""
import json
import os
import sys

import torch

from toolkit.train import mcore_cpu

mcore_cpu.enable()


def main():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from toolkit.config.store import compose_config
    from toolkit.emit.megatron import megatron_sections
    from toolkit.train.megatron_configs import build_megatron_configs
    from toolkit.plan.layout import resolve
    from toolkit.train.megatron_model import build_model_chunks, layer_spec

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    cfg = compose_config(["model=tiny", "cluster.gpus_per_node=1", "model.num_layers=2"])
    sections = megatron_sections(cfg, resolve(cfg))
    transformer_config, _, _ = build_megatron_configs(sections)
    models = []
    for sdpa in (False, True):
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        models.append(build_model_chunks(sections, transformer_config, layer_spec(transformer_config, sdpa=sdpa))[0])
    local, sdpa_model = models
    sdpa_model.load_state_dict(local.state_dict())
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length))
    positions = torch.arange(cfg.model.seq_length).expand(2, -1)
    losses = [m(tokens, positions, None, labels=tokens).mean() for m in (local, sdpa_model)]
    for loss in losses:
        loss.backward()
    grad_diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(local.parameters(), sdpa_model.parameters()))
    changed = tokens.clone()
    changed[:, 1:] = (changed[:, 1:] + 1) % cfg.model.vocab_size
    with torch.no_grad():
        first = [sdpa_model(t, positions, None, labels=tokens)[:, 0] for t in (tokens, changed)]
    print(json.dumps({"losses": [l.item() for l in losses], "grad_diff": grad_diff,
                      "core": type(sdpa_model.decoder.layers[0].self_attention.core_attention).__name__,
                      "causal": bool(torch.allclose(first[0], first[1]))}))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
