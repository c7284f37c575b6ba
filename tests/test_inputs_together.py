"""Settings valid alone but wrong together are refused before anything starts, naming both fields
and the fix, on every verb: the Slurm signal lead against the time limit, expert parallel on a
dense model along a scaling curve, an error every point of a sweep has, an initial checkpoint of
another model."""

import json
import subprocess
import sys

import pytest

from toolkit.cli import main
from toolkit.plan.rules.slurm import time_limit_seconds
from toolkit.plan.validate import validate
from toolkit.report import scale
from toolkit.report.sweep import errors_in_every_point, grid_points
from toolkit.train.checkpoint import ResumeError, model_record
from toolkit.train.launch import refuse_to_start

TWO_NODES = ["model=tiny", "cluster.nodes=2", "cluster.slurm.time=00:04:00"]


@pytest.mark.parametrize(
    "text, seconds",
    [("5", 300), ("5:30", 330), ("1:00:00", 3600), ("1-0", 86400), ("1-2:30", 95400), ("1-2:30:15", 95415)]
    + [("INFINITE", None), (None, None)],
)
def test_slurm_time_limits_read_as_sbatch_reads_them(text, seconds):
    assert time_limit_seconds(text) == seconds


def test_a_signal_lead_as_long_as_the_time_limit_is_refused_and_a_shorter_one_accepted(compose):
    errors = [e for e in validate(compose(*TWO_NODES, "cluster.slurm.signal_before_s=240")).errors]
    (error,) = [e for e in errors if e.rule == "slurm_signal"]
    assert set(error.fields) == {"cluster.slurm.signal_before_s", "cluster.slurm.time"}
    assert "below 240" in error.fix
    for neighbour in (
        [*TWO_NODES, "cluster.slurm.signal_before_s=239"],
        [*TWO_NODES, "cluster.slurm.signal_before_s=null"],
        [*TWO_NODES[:1], "cluster.slurm.time=00:04:00", "cluster.slurm.signal_before_s=300"],  # one node: no Slurm
    ):
        assert not [e for e in validate(compose(*neighbour)).errors if e.rule == "slurm_signal"], neighbour


def test_plan_and_validate_refuse_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["validate", *TWO_NODES, "cluster.slurm.signal_before_s=300"]) == 2
    assert main(["plan", *TWO_NODES, "cluster.slurm.signal_before_s=300"]) == 2
    assert "[slurm_signal]" in capsys.readouterr().out


def test_a_sweep_whose_every_point_has_an_error_starts_nothing(tmp_path):
    """Refused before Hydra writes anything; a grid where only some points are invalid runs (its
    invalid points recorded as such: tests/test_sweep.py)."""
    result = subprocess.run(
        [sys.executable, "-m", "toolkit.cli", "sweep", *TWO_NODES, "cluster.slurm.signal_before_s=300"]
        + ["parallel.tp=1,2", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "every point of the sweep has these errors" in result.stderr and "[slurm_signal]" in result.stderr
    assert not (tmp_path / "sweep").exists()
    assert grid_points(["a.b=1,2", "c=x", "hydra.sweep.dir=d"]) == [["a.b=1", "c=x"], ["a.b=2", "c=x"]]
    assert errors_in_every_point(["model=tiny", "parallel.tp=1,3"], []) == []  # tp=1 is valid


def test_scaling_expert_parallel_on_a_dense_model_is_refused_before_any_point(compose, monkeypatch, tmp_path):
    monkeypatch.setattr(scale, "run_point", lambda *a: pytest.fail("a point ran"))
    with pytest.raises(scale.ScaleError, match=r"nothing was started:\n  2 ranks: error \[ep_dense\]"):
        scale.run_scale(compose("model=tiny"), [], "ep", "weak", (1, 2), 1.6, tmp_path, scale.SweepOptions())


def test_an_initial_checkpoint_of_another_model_is_refused_before_the_ranks_start(compose, tmp_path):
    """Its manifest records the model it holds (train.save_init_checkpoint, convert hf-to-megatron)."""
    init = tmp_path / "init"
    init.mkdir()
    (init / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    saved = model_record(compose("model=tiny", "model.hidden_size=128"))
    (init / "manifest.json").write_text(json.dumps({"files": {"metadata.json": {"bytes": 33}}, "model": saved}))
    cfg = compose("model=tiny", f"train.init_checkpoint={init}", f"checkpoint.dir={tmp_path / 'checkpoints'}")
    with pytest.raises(ResumeError, match=r"holds another model: hidden_size 128 saved, 64 configured.*Fix: "):
        refuse_to_start(cfg, tmp_path / "run")
    matching = compose("model=tiny", "model.hidden_size=128", f"train.init_checkpoint={init}")
    refuse_to_start(matching, tmp_path / "run")
