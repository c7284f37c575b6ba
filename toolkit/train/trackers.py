"""The trackers a run logs to besides metrics.jsonl (train.loggers): TensorBoard, Weights & Biases and
MLflow, through their own packages. Each gets the same scalars under the same names and the run's
resolved config as its parameters. A resumed run is a new tracker run in the same group (the run's
folder, or a sweep's for its points), named after the step it resumed from, so that no tracker sees
a step twice in one run.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from toolkit.config.schema import Config
from toolkit.plan.backends import mlflow_store

# metrics.jsonl's keys and the names the trackers give them: what was measured under train/, what the
# planner predicted under planner/ (the same figures `parakit plan` prints), validation under val/.
MEASURED = (
    "loss",
    "lr",
    "grad_norm",
    "step_time_s",
    "tokens_per_s",
    "tflops_per_gpu",
    "mfu",
    "memory_gib",
    "memory_reserved_gib",
)
PREDICTED = {
    "predicted_step_time_s": "planner/step_time_s",
    "predicted_memory_gib": "planner/memory_gib",
    "predicted_reserved_gib": "planner/reserved_gib",
}
VALIDATION = {"val_loss": "val/loss", "val_ppl": "val/ppl"}


def tracked(record: dict, extra: tuple[str, ...] = ()) -> dict[str, float]:
    """A metrics.jsonl record as the trackers' scalars (`extra`: the other losses a step reports)."""
    names = {key: f"train/{key}" for key in (*MEASURED, *extra)} | PREDICTED | VALIDATION
    return {names[key]: float(value) for key, value in record.items() if key in names and value is not None}


def flat_config(cfg: Config) -> dict[str, object]:
    """The resolved config as dotted keys (train.micro_batch), as MLflow's parameters take it."""
    flat: dict[str, object] = {}

    def walk(value, prefix):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}.{key}" if prefix else key)
        else:
            flat[prefix] = value

    walk(dataclasses.asdict(cfg), "")
    return flat


class TensorBoard:
    def __init__(self, cfg: Config, run_dir: Path, name: str, group: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        config = json.dumps(dataclasses.asdict(cfg), indent=2, default=str)
        self.writer.add_text("config", "    " + config.replace("\n", "\n    "))  # markdown: a code block

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def close(self, complete: bool) -> None:
        self.writer.close()


class WeightsAndBiases:
    """wandb.init in train.wandb_mode: offline writes <run dir>/wandb/ (`wandb sync` uploads it later)."""

    def __init__(self, cfg: Config, run_dir: Path, name: str, group: str):
        import wandb

        self.run = wandb.init(
            project=cfg.train.tracker_project,
            entity=cfg.train.wandb_entity,
            name=name,
            group=group,
            dir=str(run_dir),
            mode=str(cfg.train.wandb_mode),
            config=dataclasses.asdict(cfg),
            # its console capture would wrap the streams parakit already routes (toolkit.train.console);
            # its banner is said in one line below
            settings=wandb.Settings(console="off", silent=True),
        )
        where = f"offline in {self.run.dir.removesuffix('/files')} (`wandb sync` uploads it)"
        print(f"trackers: wandb {where if self.run.offline else 'at ' + str(self.run.url)}", flush=True)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self, complete: bool) -> None:
        self.run.finish(exit_code=0 if complete else 1)


# MLflow takes at most 100 parameters per call and 6000 characters per value
# (mlflow.utils.validation: MAX_PARAMS_TAGS_PER_BATCH, MAX_PARAM_VAL_LENGTH).
MLFLOW_BATCH, MLFLOW_VALUE = 100, 6000


def mlflow_tracking_uri(cfg: Config, run_dir: Path) -> str:
    """train.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else a SQLite store in the run directory
    (MLflow's file store is deprecated; its own default is SQLite too)."""
    return mlflow_store(cfg) or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


class MLflow:
    """An MLflow run in the experiment train.tracker_project, through MlflowClient (no global active run)."""

    def __init__(self, cfg: Config, run_dir: Path, name: str, group: str):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = mlflow_tracking_uri(cfg, run_dir)
        self.client = MlflowClient(uri)
        self.pending = None  # the metric batch queued last (mlflow.utils.async_logging's RunOperations)
        experiment = self.client.get_experiment_by_name(cfg.train.tracker_project)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(cfg.train.tracker_project)
        )
        tags = {"parakit.run_dir": str(run_dir.resolve()), "parakit.group": group}
        self.run_id = self.client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
        params = [Param(key, str(value)[:MLFLOW_VALUE]) for key, value in flat_config(cfg).items()]
        for first in range(0, len(params), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[first : first + MLFLOW_BATCH])
        print(f"trackers: mlflow run {self.run_id} of experiment {cfg.train.tracker_project} in {uri}", flush=True)

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, step) for name, value in scalars.items()]
        # queued, so that the store's write is not the step's time; the previous step's is done by now
        if self.pending is not None:
            self.pending.wait()
        self.pending = self.client.log_batch(self.run_id, metrics=metrics, synchronous=False)

    def close(self, complete: bool) -> None:
        if self.pending is not None:
            self.pending.wait()
        self.client.set_terminated(self.run_id, "FINISHED" if complete else "FAILED")


TRACKERS = {"tensorboard": TensorBoard, "wandb": WeightsAndBiases, "mlflow": MLflow}
FIXES = {
    "tensorboard": "make the run directory writable",
    "wandb": "check train.wandb_mode, train.wandb_entity and train.tracker_project (offline needs no network)",
    "mlflow": "check train.mlflow_tracking_uri (else $MLFLOW_TRACKING_URI) and train.tracker_project",
}


class TrackerError(RuntimeError):
    """A tracker that could not start its run, said with the fields to check."""


def _opened(logger: str, cfg: Config, run_dir: Path, name: str, group: str):
    try:
        return TRACKERS[logger](cfg, run_dir, name, group)
    except Exception as error:
        raise TrackerError(
            f"train.loggers' {logger} could not start its run ({type(error).__name__}: {error}). "
            f"Fix: {FIXES[logger]}, or drop {logger} from train.loggers"
        ) from error


def run_group(run_dir: Path) -> str:
    """What a tracker groups the run under: a sweep's folder for its points (Hydra writes
    multirun.yaml there), else the run's own folder (its attempts, when it resumes)."""
    return run_dir.parent.name if (run_dir.parent / "multirun.yaml").is_file() else run_dir.name


class Trackers:
    """The trackers train.loggers names, opened on the rank that logs (metrics.jsonl is Metrics' own)."""

    def __init__(self, cfg: Config, run_dir: Path, resume_step: int):
        name = run_dir.name if not resume_step else f"{run_dir.name}-from-step-{resume_step}"
        group = run_group(run_dir)
        chosen = dict.fromkeys(str(logger) for logger in cfg.train.loggers)
        self.trackers = [_opened(logger, cfg, run_dir, name, group) for logger in chosen if logger in TRACKERS]

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(scalars, step)

    def close(self, complete: bool) -> None:
        for tracker in self.trackers:
            tracker.close(complete)
