"""The planner's model-state memory equals the bytes the real engines hold per rank: DeepSpeed
ZeRO 0-3 (transformers model) and megatron-core DDP with and without the distributed optimizer,
2 CPU ranks each, fp32 and bf16. Measured by counting every live tensor storage after a backward
(tests/dist/*_model_states.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.plan.layout import resolve
from toolkit.plan.memory import DTYPE_BYTES, stage_memory

DIST = Path(__file__).parent / "dist"
SMALL = ["cluster.gpus_per_node=2", "train.global_batch=4", "train.micro_batch=1", "model.seq_length=32"]
# Small DeepSpeed buckets; every ZeRO-3 parameter partitioned (no persistent small parameters).
DS_BUCKETS = ["zero.reduce_bucket_size=500000", "zero.allgather_bucket_size=500000",
              "zero.stage3_param_persistence_threshold=0", "zero.stage3_prefetch_bucket_size=500000"]
TOLERANCE = 0.005  # 0.5%: scalars, RNG states and Megatron's bucket padding

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_processes_left_behind")]


def measure(script: str, overrides: list[str], tmp_path) -> dict:
    out = tmp_path / "bytes.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(DIST / script),
           str(out), *overrides]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


# bf16 adds the low-precision copies to each stage's fp32 partitioning: checked at both ends.
@pytest.mark.parametrize("zero, dtype", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16"), (3, "bf16")])
def test_deepspeed_engine_holds_planned_model_states(compose, tmp_path, zero, dtype):
    overrides = ["backend=deepspeed", f"zero={zero}", f"precision={dtype}", *SMALL, *DS_BUCKETS]
    cfg = compose(*overrides)
    planned = stage_memory(cfg, resolve(cfg), 0)
    # At stage 3 DeepSpeed keeps its gradient reduction bucket allocated between steps.
    expected = planned.model_states + (cfg.zero.reduce_bucket_size * DTYPE_BYTES[dtype] if zero == 3 else 0)
    measured = measure("ds_model_states.py", overrides, tmp_path)
    for rank in measured["ranks"]:
        assert rank["bytes"] == pytest.approx(expected, rel=TOLERANCE), (rank, planned)


@pytest.mark.parametrize("zero, dtype", [(0, "fp32"), (1, "fp32"), (1, "bf16")])
def test_megatron_ddp_and_distributed_optimizer_hold_planned_model_states(compose, tmp_path, zero, dtype):
    overrides = ["backend=megatron", f"zero={zero}", f"precision={dtype}", *SMALL]
    cfg = compose(*overrides)
    planned = stage_memory(cfg, resolve(cfg), 0)
    measured = measure("mcore_model_states.py", overrides, tmp_path)
    for rank in measured["ranks"]:
        assert rank["bytes"] == pytest.approx(planned.model_states, rel=TOLERANCE), (rank, planned)
