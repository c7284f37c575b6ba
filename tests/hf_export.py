"""Helpers of the export tests on training runs: `parakit export` of a run's checkpoint, the
export loaded by transformers (nothing missing, unexpected or mismatched) and generating, and the
loss it computes on a step's batch (tests/dist/hf_export_check.py, in a process of its own: the
corpus dataset needs a process group)."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from toolkit import cli

CHECK = Path(__file__).parent / "dist" / "hf_export_check.py"


def export(run_dir: Path, out: Path, *options) -> Path:
    assert cli.main(["export", str(run_dir), "--output", str(out), *map(str, options)]) == 0
    return out


def loaded(hf_dir: Path):
    """The exported model as transformers loads it; it must generate."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    new = model.generate(torch.tensor([[15496, 995]]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert new.shape == (1, 6)
    return model


def checked(run_dir: Path, hf_dir: Path, step: int, megatron_checkpoint: Path | None = None) -> dict:
    """hf_export_check.py's findings: loading info, generated tokens, the loss of step `step` + 1
    recomputed from the export (and megatron-core's, over the padded vocabulary), the recorded one."""
    args = [sys.executable, str(CHECK), str(run_dir), str(hf_dir), str(step)]
    result = subprocess.run(
        args + ([str(megatron_checkpoint)] if megatron_checkpoint else []), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert not (found["missing_keys"] or found["unexpected_keys"] or found["mismatched_keys"]), found
    assert found["generated_tokens"] == 8, found
    return found
