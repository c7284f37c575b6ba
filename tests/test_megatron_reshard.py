"""When `parakit train` converts a megatron checkpoint before its ranks start
(toolkit.train.megatron_reshard), and when it refuses: decided from the checkpoint's recorded
layout and optimizer format alone. The conversion itself runs in
tests/test_faults_megatron.py::test_resume_into_another_layout."""

import json

import pytest

from toolkit.plan.layout import resolve
from toolkit.train import checkpoint as ckpt
from toolkit.train.megatron_reshard import _conversion_config, _needs_conversion, convert_for_layout

SAVED = {"tp": 1, "pp": 2, "vpp": 1, "cp": 1, "ep": 1, "dp": 1, "world": 2}


def saved_checkpoint(root, optimizer_format="dp_reshardable", layout=SAVED, model=None):
    """A published step-2 checkpoint holding only its trainer state (enough for the decision)."""
    staging = ckpt.prepare(root, 2)
    state = {"step": 2, "consumed_samples": 16, "scheduler": {}, "layout": layout, "model": model}
    if optimizer_format:
        state["optimizer_format"] = optimizer_format
    (staging / "trainer_state.json").write_text(json.dumps(state))
    return ckpt.publish(root, 2, keep_last=3)


MEGATRON = ["model=tiny", "train.global_batch=8", "train.micro_batch=1"]


@pytest.mark.parametrize(
    "overrides, optimizer_format, converts",
    [
        (["cluster.gpus_per_node=4", "parallel.tp=2", "parallel.pp=2"], "dp_reshardable", True),
        (["cluster.gpus_per_node=4", "parallel.pp=2"], "dp_reshardable", False),  # dp 1 -> 2 loads directly
        (["cluster.gpus_per_node=4", "parallel.tp=2", "parallel.pp=2"], "fully_reshardable", False),
        (["cluster.gpus_per_node=4", "parallel.tp=2", "parallel.pp=2"], None, False),  # before the format was recorded
    ],
)
def test_conversion_only_where_the_layout_cannot_load_it(tmp_path, compose, overrides, optimizer_format, converts):
    saved_checkpoint(tmp_path, optimizer_format)
    cfg = compose(*MEGATRON, *overrides)
    found = _needs_conversion(cfg, resolve(cfg), tmp_path)
    assert (found is not None) == converts
    if converts:
        assert found[2] == "tp 1 -> 2"


def test_the_conversion_runs_the_saved_layout(tmp_path, compose):
    cfg = compose(*MEGATRON, "cluster.gpus_per_node=4", "parallel.tp=2", "parallel.pp=2")
    state = ckpt.trainer_state(saved_checkpoint(tmp_path))
    conversion = _conversion_config(cfg, state, tmp_path)
    layout = resolve(conversion)
    assert (layout.tp, layout.pp, layout.dp, layout.world_size) == (1, 2, 1, 2)
    assert conversion.checkpoint.reshardable and conversion.checkpoint.dir == str(tmp_path)
    assert layout.global_batch == 8


def test_several_nodes_are_refused_with_the_fix(tmp_path, compose):
    saved_checkpoint(tmp_path)
    cfg = compose(
        *MEGATRON, "cluster.nodes=2", "cluster.gpus_per_node=2", "parallel.tp=2", f"checkpoint.dir={tmp_path}"
    )
    with pytest.raises(ckpt.ResumeError, match="reshardable=true"):
        convert_for_layout(cfg, resolve(cfg), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing started


def test_a_checkpoint_of_another_model_or_backend_is_refused_before_any_rank_starts(tmp_path, compose):
    """The newest checkpoint records the backend and architecture that saved it: `parakit train` with
    another model (or backend) under the same checkpoint.dir names what differs, starts nothing."""
    from toolkit.train.launch import refuse_to_start

    saved = compose(*MEGATRON, "cluster.gpus_per_node=1")
    saved_checkpoint(tmp_path, model=ckpt.model_record(saved))
    assert ckpt.other_model(saved, tmp_path) is None
    deeper = compose(*MEGATRON, "cluster.gpus_per_node=1", "model.num_layers=4", f"checkpoint.dir={tmp_path}")
    problem = ckpt.other_model(deeper, tmp_path)
    assert problem == f"{tmp_path / 'step_00000002'} holds another model: num_layers 8 saved, 4 configured"
    deepspeed = compose(*MEGATRON, "cluster.gpus_per_node=1", "backend=deepspeed")
    assert "backend 'megatron' saved, 'deepspeed' configured" in ckpt.other_model(deepspeed, tmp_path)
    with pytest.raises(ckpt.ResumeError, match="num_layers 8 saved, 4 configured.*another checkpoint.dir"):
        refuse_to_start(deeper, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing started
    fresh = compose(*MEGATRON, "cluster.gpus_per_node=1", "model.num_layers=4", "checkpoint.resume=false")
    assert ckpt.other_model(fresh, tmp_path / "elsewhere") is None


def test_a_resume_at_another_global_batch_is_said_before_the_ranks_start(tmp_path, compose, capsys):
    """The data is positioned by step and the schedule counts steps: at another global batch neither
    continues from the samples consumed (16 by step 2 at batch 8), which is said with the batch that
    would."""
    from toolkit.train.launch import refuse_to_start

    saved_checkpoint(tmp_path)
    assert ckpt.other_batch(compose(*MEGATRON), tmp_path) is None
    wider = compose(*MEGATRON, "train.global_batch=16", f"checkpoint.dir={tmp_path}")
    note = ckpt.other_batch(wider, tmp_path)
    assert "trained at global batch 8 (16 samples by step 2)" in note and "starts at sample 32" in note
    assert note.endswith("Fix, to continue exactly: train.global_batch=8")
    refuse_to_start(wider, tmp_path / "run")  # said, not refused
    assert "warning [resume_batch] step_00000002 was trained at global batch 8" in capsys.readouterr().err


def test_a_checkpoint_from_before_the_record_is_left_to_the_load(tmp_path, compose):
    saved_checkpoint(tmp_path)  # no "model": saved by an earlier parakit
    assert ckpt.other_model(compose(*MEGATRON, "model.num_layers=4"), tmp_path) is None
