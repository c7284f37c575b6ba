"""What a run's trackers wrote, read back through each tracker's own reader: TensorBoard's event
accumulator, MLflow's client over the run's SQLite store, and a W&B offline run's transaction log
(`run-ID.wandb`: LevelDB's log format of wandb's protobuf Records; wandb 0.31 ships no reader)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

# {run name: {"params": {dotted key: value}, "scalars": {name: {step: value}}}}
Runs = dict[str, dict]


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar, the last value written per step (a resumed run's repeated steps replace the first)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def mlflow_runs(run_dir: Path, experiment: str = "parakit") -> Runs:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id], order_by=["start_time"])
    runs = {}
    for run in found:
        scalars = {
            name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
            for name in run.data.metrics
        }
        runs[run.info.run_name] = {
            "params": run.data.params,
            "scalars": scalars,
            "status": run.info.status,
            "group": run.data.tags.get("parakit.group"),
        }
    return runs


# LevelDB's log format (leveldb doc/log_format.md): 32 KiB blocks of records, each a 7-byte header
# (CRC32, length, type: 1 full, 2 first, 3 middle, 4 last); wandb's file opens with a 7-byte header of
# its own (":W&B", magic, version).
BLOCK, HEADER = 32768, 7


def _wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    position, pending = HEADER, b""
    while position + HEADER <= len(data):
        if BLOCK - position % BLOCK < HEADER:  # a block's tail too short for a header is padding
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        pending += data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_runs(run_dir: Path) -> Runs:
    runs = {}
    for log in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        name, group, params, scalars = None, None, {}, {}
        for record in _wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                name, group = record.run.display_name, record.run.run_group
                params = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "history":
                # wandb keeps "train/loss" as the nested key ("train", "loss")
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                for key, value in items.items():
                    if not key.startswith("_"):  # wandb's own: _step, _runtime, _timestamp
                        scalars.setdefault(key, {})[record.history.step.num] = value
        runs[name] = {"params": params, "scalars": scalars, "group": group}
    return runs
