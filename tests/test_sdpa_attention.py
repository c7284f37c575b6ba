"""torch SDPA as megatron-core's core attention computes what the local unfused attention does
(causal mask, grouped KV heads), forward and backward (run in a subprocess: it needs the CPU
compatibility layer)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


def test_sdpa_core_attention_matches_local_attention():
    script = Path(__file__).parent / "dist" / "sdpa_check.py"
    result = subprocess.run([sys.executable, str(script), "29537"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["core"] == "SdpaAttention"
    assert out["losses"][0] == pytest.approx(out["losses"][1], abs=1e-5)
    assert out["grad_diff"] < 1e-5
    assert out["causal"]
