"""Convert megatron-core weights (a dist checkpoint saved at any tp/pp layout, e.g. by
train.save_init_checkpoint) into a Hugging Face transformers directory (config.json +
model.safetensors) that `backend=deepspeed model.hf_path=...` or transformers can load.

    python -m toolkit.interop.megatron_to_hf --config RUN_DIR/config.yaml --checkpoint CKPT_DIR --out HF_DIR

(`parakit reproduce --backends megatron,deepspeed` starts DeepSpeed from megatron's initial weights so.)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from toolkit.train import mcore_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True, help="the run's resolved config.yaml")
    parser.add_argument("--checkpoint", type=Path, required=True, help="megatron-core dist checkpoint of the model")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    mcore_cpu.enable()
    from megatron.core import dist_checkpointing, parallel_state
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from toolkit.config.store import load_run_config
    from toolkit.emit.megatron import megatron_sections
    from toolkit.families.hf_config import hf_config
    from toolkit.families.to_hf import megatron_to_hf
    from toolkit.plan.layout import resolve
    from toolkit.train.hf_convert import single_process
    from toolkit.train.megatron_model import build_model_chunks

    cfg = load_run_config(args.config.parent, args.config.stem)
    # One process holds the whole model: tp = pp = 1 (dist_checkpointing reshards on load).
    cfg = single_process(cfg)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), RANK="0", WORLD_SIZE="1"
    )
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    (model,) = build_model_chunks(megatron_sections(cfg, resolve(cfg)))
    model.load_state_dict(
        dist_checkpointing.load({"chunk0": model.sharded_state_dict()}, str(args.checkpoint))["chunk0"]
    )
    config = hf_config(cfg.model)
    hf_model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    hf_model.load_state_dict(megatron_to_hf(model.state_dict(), cfg.model), strict=True)
    hf_model.save_pretrained(args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in hf_model.parameters()):,} parameters")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
