"""What parakit builds where CUDA is present, checked on this CPU machine: the branches that run
only on GPUs are driven here with torch.cuda patched to report a device (tests/dist/cuda_branches.py,
one process for all the megatron-core facts), or read from what is emitted for a GPU cluster."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "dist" / "cuda_branches.py"


@pytest.fixture(scope="module")
def facts():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_torch_adam_resume_fixes_are_installed_on_a_gpu_without_te_or_apex(facts):
    """megatron-core runs torch's AdamW there as on CPU: without the fixes a resume raises
    KeyError 'step' or shares one step tensor between all parameters."""
    assert not facts["cpu_layer_entered"]
    assert facts["torch_adam_resume_fixes"]


def test_a_gpu_without_te_builds_the_local_spec_with_sdpa_sequence_parallel_norms_on_the_device(facts):
    assert facts["core_attention"] == "SdpaAttention"
    assert facts["norms"] == ["RMSNorm"] and facts["norm_weights_marked"]
    assert facts["chunks_moved_to_gpu"] == 1  # Megatron-LM's get_model: torch norms are built on the host
