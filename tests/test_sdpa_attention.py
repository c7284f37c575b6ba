"""torch SDPA as megatron-core's core attention computes what the local unfused attention does
(causal mask, grouped KV heads, and megatron-core's sliding window), forward and backward; its
context-parallel masks, reassembled over the cp ranks, are megatron-core's own masks (run in a
subprocess: it needs the CPU compatibility layer). The multi-rank parity of context parallel is
tests/test_train_megatron.py's."""

import json
import subprocess
from pathlib import Path

import pytest
from training_runs import python


@pytest.fixture(scope="module")
def checked():
    script = Path(__file__).parent / "dist" / "sdpa_check.py"
    # port 0: the one process's store binds any free port
    result = subprocess.run([python(), str(script), "0"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_sdpa_core_attention_matches_local_attention(checked):
    assert checked["core"] == "SdpaAttention"
    assert checked["losses"][0] == pytest.approx(checked["losses"][1], abs=1e-5)
    assert checked["grad_diff"] < 1e-5
    assert checked["causal"]


def test_sliding_window_matches_local_attention_and_hides_what_is_outside(checked):
    """megatron-core's local attention masks the window in its softmax (get_sliding_window_causal_mask);
    SDPA masks it by positions: the same losses and gradients, and a token beyond the window's
    reach (two layers: twice the window) leaves the last position unchanged."""
    assert checked["window_losses"][0] == pytest.approx(checked["window_losses"][1], abs=1e-5)
    assert checked["window_losses"][0] != pytest.approx(checked["losses"][0], abs=1e-4)  # the window matters
    assert checked["window_grad_diff"] < 1e-5
    assert checked["window_unchanged_outside"] and checked["window_changed_inside"]


def test_context_parallel_masks_are_megatron_cores(checked):
    assert checked["cp_positions_cover_the_sequence"]
    assert checked["cp_masks"] and all(checked["cp_masks"].values()), checked["cp_masks"]
