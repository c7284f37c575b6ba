"""train.loggers: TensorBoard, Weights & Biases (offline) and MLflow (a SQLite store in the run
directory) get the same scalars under the same names and the resolved config as parameters; a
resumed run is a new tracker run; a missing package is the validator's error naming it. The trackers
of a real two-rank run that resumes: tests/test_own_data.py."""

import math
import tomllib
from pathlib import Path

import pytest
from tracker_logs import mlflow_runs, tensorboard_scalars, wandb_runs

from toolkit.plan.backends import TRACKER_PACKAGES, packages_needed
from toolkit.plan.validate import validate
from toolkit.train.trackers import TrackerError, Trackers, tracked

ALL = "train.loggers=[jsonl,tensorboard,wandb,mlflow]"


def step_record(step: int, loss: float) -> dict:
    """A metrics.jsonl step record as toolkit.train.metrics writes it (CPU: no reserved memory)."""
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3 * step,
        "grad_norm": None if step == 1 else 0.5,  # a skipped step has none: not logged
        "skipped": False,
        "step_time_s": 0.25,
        "tokens_per_s": 4096.0,
        "tflops_per_gpu": 0.01,
        "mfu": 0.1,
        "memory_gib": 0.7,
        "predicted_step_time_s": 0.3,
        "predicted_memory_gib": 0.12,
        "moe_aux_loss": 1.01,
    }


def test_the_scalars_are_metrics_jsonl_under_train_planner_and_val_names():
    scalars = tracked(step_record(2, 3.5), extra=("moe_aux_loss",))
    assert scalars == {
        "train/loss": 3.5,
        "train/lr": 2e-3,
        "train/grad_norm": 0.5,
        "train/step_time_s": 0.25,
        "train/tokens_per_s": 4096.0,
        "train/tflops_per_gpu": 0.01,
        "train/mfu": 0.1,
        "train/memory_gib": 0.7,
        "train/moe_aux_loss": 1.01,
        "planner/step_time_s": 0.3,
        "planner/memory_gib": 0.12,
    }
    assert "train/grad_norm" not in tracked(step_record(1, 3.5))
    assert "train/moe_aux_loss" not in tracked(step_record(1, 3.5))  # only the losses the step reports
    assert tracked({"step": 4, "val_loss": 2.0, "val_ppl": math.exp(2.0)}) == {"val/loss": 2.0, "val/ppl": math.exp(2)}


def test_every_tracker_gets_the_same_scalars_and_the_config_and_a_resume_is_a_new_run(compose, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")  # train.wandb_mode decides, not the environment
    monkeypatch.chdir(tmp_path)  # nothing lands in the working directory
    cfg = compose(ALL, "train.steps=7")
    run_dir = tmp_path / "run"
    first = Trackers(cfg, run_dir, resume_step=0)
    logged = {}
    for step, loss in [(1, 4.0), (2, 3.5), (3, 3.25)]:
        logged[step] = tracked(step_record(step, loss))
        first.log(logged[step], step)
    first.log(tracked({"step": 3, "val_loss": 3.0, "val_ppl": math.exp(3.0)}), 3)
    first.close(complete=False)  # stopped after step 3, resumed from a step-2 checkpoint
    resumed = Trackers(cfg, run_dir, resume_step=2)
    logged[3] = tracked(step_record(3, 3.125))
    resumed.log(logged[3], 3)
    resumed.close(complete=True)

    expected = {name: {step: s[name] for step, s in logged.items() if name in s} for name in logged[2]}
    board = tensorboard_scalars(run_dir)
    assert set(board) == set(expected) | {"val/loss", "val/ppl"}
    for name, steps in expected.items():  # float32 events; the resumed step 3 replaced the first
        assert board[name] == pytest.approx(steps, rel=1e-6), name
    for runs in (wandb_runs(run_dir), mlflow_runs(run_dir)):
        assert list(runs) == ["run", "run-from-step-2"]
        before, after = runs["run"]["scalars"], runs["run-from-step-2"]["scalars"]
        assert before["train/loss"] == {1: 4.0, 2: 3.5, 3: 3.25} and after["train/loss"] == {3: 3.125}
        assert before["val/loss"] == {3: 3.0} and before["planner/step_time_s"] == {1: 0.3, 2: 0.3, 3: 0.3}
        assert set(after) == set(logged[3])
        assert before["train/grad_norm"] == {2: 0.5, 3: 0.5}
    mlflow, wandb = mlflow_runs(run_dir), wandb_runs(run_dir)
    assert [r["status"] for r in mlflow.values()] == ["FAILED", "FINISHED"]
    assert mlflow["run"]["params"]["train.steps"] == "7" and mlflow["run"]["params"]["model.name"] == "tiny"
    assert wandb["run"]["params"]["train"]["steps"] == 7 and wandb["run"]["params"]["model"]["name"] == "tiny"
    assert len(mlflow["run"]["params"]) > 100  # past one MLflow batch: every field
    assert {r["group"] for r in [*mlflow.values(), *wandb.values()]} == {"run"}  # the run's attempts
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_missing_tracker_package_is_an_error_naming_it(compose):
    cfg = compose(ALL)
    assert [p.name for p in packages_needed(cfg)] == ["wandb", "mlflow", "alembic"]
    assert packages_needed(compose()) == []
    # an MLflow server stores for itself: no SQLAlchemy here
    served = compose(ALL, "train.mlflow_tracking_uri=http://mlflow.example:5000")
    assert [p.name for p in packages_needed(served)] == ["wandb", "mlflow"]
    for module, install in [("wandb", "wandb==0.31.0"), ("mlflow", "mlflow-skinny==3.18.0")]:
        report = validate(cfg, installed=lambda m, missing=module: m != missing)
        (error,) = [e for e in report.errors if e.rule == "package"]
        assert f"cannot import {module}" in error.message and install in error.fix, error
        assert f"drop {module} from train.loggers" in error.fix


def test_the_packages_the_validator_asks_for_are_the_extra_the_tests_run():
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    asked = {pin for package in TRACKER_PACKAGES for pin in package.install.split()}
    assert asked == set(extras["trackers"])


def test_leaving_jsonl_out_is_said_and_metrics_jsonl_still_written(compose):
    report = validate(compose("train.loggers=[tensorboard]"))
    (warning,) = [w for w in report.warnings if w.rule == "loggers"]
    assert "metrics.jsonl in any case" in warning.message
    assert not [w for w in validate(compose()).warnings if w.rule == "loggers"]


def test_an_unknown_logger_is_refused_with_the_choices(compose):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as error:
        compose("train.loggers=[jsonl,wandbb]")
    said = str(error.value.__cause__)
    assert "'wandbb'" in said and "[jsonl, tensorboard, wandb, mlflow]" in said and "train.loggers[1]" in said


def test_a_tracker_that_cannot_start_names_the_fields_to_check(compose, tmp_path):
    cfg = compose("train.loggers=[jsonl,mlflow]", "train.mlflow_tracking_uri=nosuchstore://here")
    with pytest.raises(TrackerError) as error:
        Trackers(cfg, tmp_path / "run", resume_step=0)
    said = str(error.value)
    assert "train.loggers' mlflow could not start its run (" in said and "nosuchstore" in said
    assert "Fix: check train.mlflow_tracking_uri" in said and "drop mlflow from train.loggers" in said


def test_wandb_online_without_credentials_is_refused_before_the_ranks_start(compose, tmp_path, monkeypatch):
    from toolkit.plan.validate import validate

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    online = compose("train.loggers=[jsonl,wandb]", "train.wandb_mode=online")
    (error,) = [e for e in validate(online, gpus=0).errors if e.rule == "wandb_login"]
    assert "no WANDB_API_KEY and no api.wandb.ai entry" in error.message and "train.wandb_mode=offline" in error.fix
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password abc\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert not [e for e in validate(online, gpus=0).errors if e.rule == "wandb_login"]
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "abc")
    assert not [e for e in validate(online, gpus=0).errors if e.rule == "wandb_login"]
    assert not [e for e in validate(compose("train.loggers=[jsonl,wandb]"), gpus=0).errors if e.rule == "wandb_login"]


def test_a_sweeps_points_are_grouped_under_the_sweep(compose, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    sweep = tmp_path / "grid"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("hydra: {}\n")  # what Hydra writes into a sweep's folder
    cfg = compose("train.loggers=[jsonl,wandb,mlflow]")
    Trackers(cfg, sweep / "point-1", resume_step=0).close(complete=True)
    (point,) = wandb_runs(sweep / "point-1").values()
    assert point["group"] == "grid" and mlflow_runs(sweep / "point-1")["point-1"]["group"] == "grid"


def test_an_mlflow_server_that_does_not_answer_is_refused_before_the_ranks_start(compose, monkeypatch):
    import http.server
    import socket
    import threading

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def refused(cfg):
        return [e for e in validate(cfg, gpus=0).errors if e.rule == "mlflow_server"]

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    (error,) = refused(compose("train.loggers=[jsonl,mlflow]", f"train.mlflow_tracking_uri=http://127.0.0.1:{port}"))
    assert f"no MLflow server answers at http://127.0.0.1:{port}" in error.message
    assert "train.mlflow_tracking_uri" in error.fields and "mlflow server" in error.fix
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    (error,) = refused(compose("train.loggers=[jsonl,mlflow]"))
    assert "$MLFLOW_TRACKING_URI" in error.fields
    assert not refused(compose("train.loggers=[jsonl]"))  # no mlflow: nothing contacted

    class Answers(http.server.BaseHTTPRequestHandler):  # a server behind a login answers 401
        def do_GET(self):
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}"
        assert not refused(compose("train.loggers=[jsonl,mlflow]", f"train.mlflow_tracking_uri={uri}"))
    finally:
        server.shutdown()
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert not refused(compose("train.loggers=[jsonl,mlflow]", "train.mlflow_tracking_uri=sqlite:///x.db"))
