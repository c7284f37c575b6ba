"""Build the tiny model with megatron-core's local core attention and with torch SDPA, same
weights, with and without a sliding window; print as JSON the losses, the largest gradient
difference, the causality and window checks, and the context-parallel masks against
megatron-core's own sliding-window mask."""
import json
import os
import sys

import torch

from toolkit.train import mcore_cpu

mcore_cpu.enable()

WINDOW = 16


def compare(cfg, window):
    """(losses of local and SDPA attention, largest gradient difference, the SDPA model, tokens)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from toolkit.emit.megatron import megatron_sections
    from toolkit.plan.layout import resolve
    from toolkit.train.megatron_configs import build_megatron_configs
    from toolkit.train.megatron_model import build_model_chunks, layer_spec

    sections = megatron_sections(cfg, resolve(cfg))
    transformer_config, _, _ = build_megatron_configs(sections)
    models = []
    for sdpa in (False, True):
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        models.append(build_model_chunks(sections, transformer_config, layer_spec(transformer_config, sdpa=sdpa))[0])
    local, sdpa_model = models
    sdpa_model.load_state_dict(local.state_dict())
    torch.manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length))
    positions = torch.arange(cfg.model.seq_length).expand(2, -1)
    losses = [m(tokens, positions, None, labels=tokens).mean() for m in (local, sdpa_model)]
    for loss in losses:
        loss.backward()
    grad_diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(local.parameters(), sdpa_model.parameters()))
    return [loss.item() for loss in losses], grad_diff, sdpa_model, tokens, positions


def unchanged_where(model, tokens, positions, changed_from, changed_to, seen_at):
    """Whether the logits at `seen_at` stay the same when tokens[changed_from:changed_to] change."""
    changed = tokens.clone()
    changed[:, changed_from:changed_to] = (changed[:, changed_from:changed_to] + 1) % model.vocab_size
    with torch.no_grad():
        out = [model(t, positions, None)[:, seen_at] for t in (tokens, changed)]
    return bool(torch.allclose(out[0], out[1]))


def main():
    from megatron.core import parallel_state
    from megatron.core.transformer.utils import get_sliding_window_causal_mask

    from toolkit.config.store import compose_config
    from toolkit.train.sdpa_attention import cp_positions, visible

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    base = ["model=tiny", "cluster.gpus_per_node=1", "model.num_layers=2"]
    losses, grad_diff, model, tokens, positions = compare(compose_config(base), None)
    w_losses, w_grad_diff, w_model, w_tokens, w_positions = compare(
        compose_config([*base, f"model.sliding_window={WINDOW}"]), (WINDOW, 0)
    )
    last = tokens.size(1) - 1
    # Context parallel masks: each cp rank's queries against the gathered keys, reassembled in
    # sequence order, must be megatron-core's mask (visible = not hidden).
    cp_masks = {}
    for cp in (2, 4):
        seq = 8 * cp
        keys = torch.cat([cp_positions(seq // cp, r, cp) for r in range(cp)])
        for window in (None, (5, 0)):
            full = torch.zeros(seq, seq, dtype=torch.bool)
            for rank in range(cp):
                queries = cp_positions(seq // cp, rank, cp)
                full[queries[:, None], keys[None, :]] = visible(queries, keys, window)
            expected = ~get_sliding_window_causal_mask(seq, seq, window) if window else torch.ones(seq, seq).tril() > 0
            cp_masks[f"cp{cp}_window{window}"] = bool(torch.equal(full, expected))
    covered = sorted(torch.cat([cp_positions(8, r, 4) for r in range(4)]).tolist()) == list(range(32))
    print(
        json.dumps(
            {
                "losses": losses,
                "grad_diff": grad_diff,
                "core": type(model.decoder.layers[0].self_attention.core_attention).__name__,
                "causal": unchanged_where(model, tokens, positions, 1, None, 0),
                "window_losses": w_losses,
                "window_grad_diff": w_grad_diff,
                # two layers: the last position sees up to 2 x WINDOW tokens back
                "window_unchanged_outside": unchanged_where(w_model, w_tokens, w_positions, 0, last - 2 * WINDOW, last),
                "window_changed_inside": not unchanged_where(
                    w_model, w_tokens, w_positions, last - WINDOW, last - WINDOW + 1, last
                ),
                "cp_masks": cp_masks,
                "cp_positions_cover_the_sequence": covered,
            }
        )
    )
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
