"""The planner's model-state memory equals the bytes the real engines hold per rank: DeepSpeed
ZeRO 0-3 (transformers model) and megatron-core DDP with and without the distributed optimizer,
2 CPU ranks each, fp32 and bf16. Measured by counting every live tensor storage after a backward
(tests/dist/*_model_states.py): one launch per backend measures all its cases, one after another."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from training_runs import processes_naming, python

from toolkit.plan.layout import resolve
from toolkit.plan.memory import stage_memory

DIST = Path(__file__).parent / "dist"
SMALL = ["cluster.gpus_per_node=2", "train.global_batch=4", "train.micro_batch=1", "model.seq_length=32"]
# Small DeepSpeed buckets; every ZeRO-3 parameter partitioned (no persistent small parameters).
DS_BUCKETS = [
    "zero.reduce_bucket_size=500000",
    "zero.allgather_bucket_size=500000",
    "zero.stage3_param_persistence_threshold=0",
    "zero.stage3_prefetch_bucket_size=500000",
]
TOLERANCE = 0.005  # 0.5%: scalars, RNG states and Megatron's bucket padding
# bf16 adds the low-precision copies to each stage's fp32 partitioning, and with grad_reduce_in_fp32
# (the default) fp32 gradients: a full buffer beside the bf16 ones at stage 1 (DeepSpeed's
# BF16_Optimizer, measured last: it keeps its gradients referenced after the engine is destroyed),
# fp32 partitions from stage 2 on.
DS_CASES = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16"), (2, "bf16"), (3, "bf16"), (1, "bf16")]
MCORE_CASES = [(0, "fp32"), (1, "fp32"), (1, "bf16")]

pytestmark = pytest.mark.slow


def ds_overrides(zero, dtype):
    return ["backend=deepspeed", f"zero={zero}", f"precision={dtype}", *SMALL, *DS_BUCKETS]


def mcore_overrides(zero, dtype):
    return ["backend=megatron", f"zero={zero}", f"precision={dtype}", *SMALL]


def measure(script: str, cases: list[list[str]], tmp: Path) -> list[dict]:
    """One 2-rank launch of `script` over every override list in `cases`: a result per case."""
    (tmp / "cases.json").write_text(json.dumps(cases))
    out = tmp / "bytes.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [
        python(),
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(DIST / script),
        str(tmp / "cases.json"),
        str(out),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    time.sleep(1)  # no rank outlives the launch (their command lines name `tmp`)
    left = processes_naming(str(tmp))
    assert not left, f"processes left behind: {left}"
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def ds_measured(tmp_path_factory) -> dict:
    cases = [ds_overrides(*case) for case in DS_CASES]
    return dict(zip(DS_CASES, measure("ds_model_states.py", cases, tmp_path_factory.mktemp("ds"))))


@pytest.fixture(scope="module")
def mcore_measured(tmp_path_factory) -> dict:
    cases = [mcore_overrides(*case) for case in MCORE_CASES]
    return dict(zip(MCORE_CASES, measure("mcore_model_states.py", cases, tmp_path_factory.mktemp("mcore"))))


@pytest.mark.parametrize("zero, dtype", DS_CASES)
def test_deepspeed_engine_holds_planned_model_states(compose, ds_measured, zero, dtype):
    cfg = compose(*ds_overrides(zero, dtype))
    planned = stage_memory(cfg, resolve(cfg), 0)
    # At stage 3 DeepSpeed keeps its gradient reduction bucket allocated between steps, in the
    # reduction's dtype (fp32: grad_reduce_in_fp32 is emitted as communication_data_type).
    expected = planned.model_states + (cfg.zero.reduce_bucket_size * 4 if zero == 3 else 0)
    for rank in ds_measured[zero, dtype]["ranks"]:
        assert rank["bytes"] == pytest.approx(expected, rel=TOLERANCE), (rank, planned)


@pytest.mark.parametrize("zero, dtype", MCORE_CASES)
def test_megatron_ddp_and_distributed_optimizer_hold_planned_model_states(compose, mcore_measured, zero, dtype):
    cfg = compose(*mcore_overrides(zero, dtype))
    planned = stage_memory(cfg, resolve(cfg), 0)
    for rank in mcore_measured[zero, dtype]["ranks"]:
        assert rank["bytes"] == pytest.approx(planned.model_states, rel=TOLERANCE), (rank, planned)
