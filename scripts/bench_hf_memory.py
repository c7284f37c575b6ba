"""Host memory of reading Hugging Face weights into a megatron-core model, measured.

Makes a Llama-style model of a few hundred MB with transformers (random weights, saved with
save_pretrained into a temporary directory), then, each in a fresh process:
  streaming  builds the megatron-core GPTModel (tp = pp = 1) and fills it with
             toolkit.families.hf_weights (safe_open, one tensor at a time);
  whole      the same, after reading the whole state dict into memory first (what loading a
             Hugging Face model, then converting it, holds), for comparison;
  convert    `parakit convert hf-to-megatron` end to end (its own peak RSS).
For the first two it prints the extra resident memory while loading (the peak, VmHWM, reset
through /proc/self/clear_refs just before, minus the resident memory before), next to the
largest tensor and the model's size. Resident memory counts the mapped file pages of the tensor
being read (safe_open maps the file) as well as its copy: about twice the largest tensor.

    python scripts/bench_hf_memory.py [--hidden 768 --layers 6 --vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 2**20


def _status(field: str) -> int:
    """A /proc/self/status memory field (kB) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0, proc(5))


def child(mode: str, hf_dir: str) -> None:
    import torch

    from toolkit.config.store import compose_config
    from toolkit.train import mcore_cpu
    from toolkit.train.hf_convert import single_process

    mcore_cpu.enable()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from toolkit.emit.megatron import megatron_sections
    from toolkit.families.hf_weights import load_hf_into_chunks
    from toolkit.plan.layout import resolve
    from toolkit.train.distributed import init_process_group
    from toolkit.train.megatron_model import build_model_chunks

    cfg = single_process(compose_config(["model=hf", f"model.hf_path={hf_dir}", "data=synthetic"]))
    init_process_group()
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    (chunk,) = build_model_chunks(megatron_sections(cfg, resolve(cfg)))
    params = list(chunk.parameters())
    before = _status("VmRSS")
    _reset_peak()
    if mode == "streaming":
        load_hf_into_chunks([chunk], hf_dir, cfg.model)
    else:  # the whole Hugging Face state dict in memory, then the same per-tensor copy
        from safetensors.torch import load_file

        # load_file maps the file; clone: the state dict held in memory, as a whole-model load has it
        state = {k: v.clone() for k, v in load_file(str(Path(hf_dir) / "model.safetensors")).items()}
        load_hf_into_chunks([chunk], hf_dir, cfg.model)
        del state
    peak = _status("VmHWM")
    print(
        json.dumps(
            {
                "model_bytes": sum(p.numel() * p.element_size() for p in params),
                "largest_tensor_bytes": max(p.numel() * p.element_size() for p in params),
                "rss_before_load_bytes": before,
                "extra_peak_bytes": peak - before,
            }
        )
    )
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def make_model(directory: Path, hidden: int, layers: int, vocab: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "HF_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "llama"
        make_model(hf_dir, args.hidden, args.layers, args.vocab)  # measured in other processes
        file_mib = (hf_dir / "model.safetensors").stat().st_size / MIB
        print(f"model: Llama-style, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {file_mib:.0f} MiB")
        for mode in ("streaming", "whole"):
            command = [sys.executable, __file__, "--child", mode, str(hf_dir)]
            out = subprocess.run(command, check=True, env=env, capture_output=True, text=True)
            r = {k: v / MIB for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}
            print(
                f"{mode:>9}: extra peak while loading {r['extra_peak_bytes']:7.1f} MiB; largest tensor "
                f"{r['largest_tensor_bytes']:.1f} MiB, model {r['model_bytes']:.1f} MiB "
                f"(resident before loading {r['rss_before_load_bytes']:.0f} MiB)"
            )
        out = subprocess.run(
            [sys.executable, "-m", "toolkit.cli", "convert", "hf-to-megatron", str(hf_dir), "--output", f"{tmp}/mc"],
            check=True,
            env=env,
            capture_output=True,
            text=True,
        )
        print("  convert:", out.stdout.strip().splitlines()[0])


if __name__ == "__main__":
    main()
