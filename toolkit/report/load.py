"""What `parakit report DIR` reads: a sweep directory (sweep.json), a scaling run (sweep.json with
a "scaling" block) or one training run directory (metrics.jsonl), as one shape: rows in the
sweep's columns, each with its loss curve and, for pipeline layouts, its time per stage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.plan.doublings import DEFAULT_THRESHOLD
from toolkit.plan.parallel_dims import DIMS
from toolkit.report.sweep import _layout_fields, _predicted, measured, read_metrics, read_result


def layout_keys() -> tuple[str, ...]:
    """Every field that tells one layout from another, besides the world size."""
    return ("backend", *(d.name for d in DIMS), "zero", "micro_batch", "recompute", "precision")


class NotAReportDir(ValueError):
    """DIR holds none of what a report reads."""


@dataclass
class Point:
    """One row of the report: the sweep's row, its label (P1, P2, ... in the table and the plots),
    its loss curve, and its per-stage step times (pipeline layouts only)."""

    row: dict
    label: str
    losses: list[tuple[int, float]] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    # Seconds per step each pipeline stage computes (micro-batches x one micro-batch's fwd+bwd).
    predicted_stage_times: list[float] = field(default_factory=list)
    measured_stage_times: list[float] | None = None  # result.json "stage_times_s", when a run records it

    @property
    def measured(self) -> bool:
        """Finished with figures: a failed run's partial figures (killed mid-way) are in the table
        but stay off the throughput, efficiency and prediction plots."""
        return self.row.get("status") == "ok" and bool(self.row.get("step_time_s"))

    @property
    def layout(self) -> str:
        return self.describe()

    def describe(self, varying: str | None = None) -> str:
        """Short layout name for legends: backend, the parallel sizes that are not 1 (`varying`,
        the dimension a curve scales, as N), ZeRO stage and micro batch."""
        r = self.row
        sizes = [
            f"{k}=N" if k == varying else f"{k}{r[k]}"
            for k in (d.name for d in DIMS)
            if k == varying or r.get(k) not in (None, 1)
        ]
        batch = f"zero{r.get('zero', 0)} mb{r.get('micro_batch', '?')}"
        return f"{r.get('backend', '?')} {' '.join(sizes) or '1 rank'} {batch}"


@dataclass
class ReportData:
    kind: str  # "sweep", "scaling" or "run"
    directory: Path
    points: list[Point]
    scaling: dict | None = None  # {"dimension", "mode", "threshold"} of a scaling run

    @property
    def threshold(self) -> float:
        return float((self.scaling or {}).get("threshold", DEFAULT_THRESHOLD))

    @property
    def scaling_description(self) -> str:
        """ "strong scaling of dp" (a scaling run; "" otherwise)."""
        if not self.scaling:
            return ""
        mode = self.scaling.get("mode")
        return f"{mode + ' ' if mode else ''}scaling of {self.scaled_dimension}"

    @property
    def scaled_dimension(self) -> str:
        """The dimension whose doubling adds ranks: the scaling run's, else dp (a plain sweep's
        points that differ only in dp form one curve)."""
        return (self.scaling or {}).get("dimension", "dp")


def _planned(run_dir: Path):
    """(Config, Layout) from the run's config.yaml, or None where there is none or it no longer
    reads (an older parakit's, or edited by hand): the report then shows the measurements alone."""
    from toolkit.config.store import load_run_config
    from toolkit.plan.layout import resolve

    if not (run_dir / "config.yaml").is_file():
        return None
    try:
        cfg = load_run_config(run_dir)
        return cfg, resolve(cfg)
    except Exception:  # OmegaConf's and the layout's many errors: all mean "no prediction"
        return None


def _predicted_stage_times(run_dir: Path) -> list[float]:
    """The planner's busy seconds per step on each stage of the run's layout."""
    from toolkit.plan.perf import estimate_step

    planned = _planned(run_dir)
    if planned is None:
        return []
    cfg, layout = planned
    return [layout.num_microbatches * t for t in estimate_step(cfg, layout).stage_times]


def _run_dir(row: dict, directory: Path) -> Path | None:
    """The point's run directory; looked up beside sweep.json when the sweep was moved or copied
    (sweep.json records absolute paths)."""
    if not row.get("run_dir"):
        return None
    recorded = Path(row["run_dir"])
    moved = directory / recorded.name
    return recorded if recorded.is_dir() or not moved.is_dir() else moved


def _point(row: dict, label: str, directory: Path) -> Point:
    point = Point(row, label)
    run_dir = _run_dir(row, directory)
    if run_dir is None:
        return point
    records = read_metrics(run_dir)
    point.losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    point.val_losses = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if (row.get("pp") or 1) > 1 and row.get("status") != "invalid":
        point.predicted_stage_times = _predicted_stage_times(run_dir)
        recorded = read_result(run_dir).get("stage_times_s")
        if isinstance(recorded, list) and len(recorded) == len(point.predicted_stage_times):  # one per stage
            point.measured_stage_times = recorded
    return point


def _run_row(run_dir: Path, warmup_steps: int) -> dict:
    """One training run as a sweep row: its layout and predictions from config.yaml, its
    measurements from metrics.jsonl; ok when it finished (result.json), else failed."""
    row = {"point": run_dir.name, "run_dir": str(run_dir), "error": ""}
    planned = _planned(run_dir)
    if planned is not None:
        row |= _layout_fields(*planned) | _predicted(*planned)
    row |= measured(run_dir, warmup_steps)
    finished = (run_dir / "result.json").is_file()
    row["status"] = "ok" if finished else "failed"
    if not finished:
        row["error"] = "the run did not finish (no result.json)"
    return row


def _order(row: dict) -> tuple:
    """Table order: by world size, then layout (invalid points, without a world size, last)."""
    return (row.get("world_size") is None, row.get("world_size") or 0, *(str(row.get(k)) for k in layout_keys()))


def load(directory: Path, warmup_steps: int = 2) -> ReportData:
    """Read DIR; NotAReportDir (one line naming what was expected) when it is none of the three."""
    directory = Path(directory)
    sweep_json = directory / "sweep.json"
    if sweep_json.is_file():
        try:
            data = json.loads(sweep_json.read_text())
            rows = data["points"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise NotAReportDir(f"{sweep_json} is not a sweep's record ({type(error).__name__}: {error})") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise NotAReportDir(f"{sweep_json} is not a sweep's record: its points are not a list of rows")
        scaling = data.get("scaling")
        kind = "scaling" if scaling else "sweep"
    elif (directory / "metrics.jsonl").is_file():
        rows, scaling, kind = [_run_row(directory, warmup_steps)], None, "run"
    elif not directory.is_dir():
        raise NotAReportDir(f"{directory} is not a directory")
    else:
        raise NotAReportDir(
            f"{directory} has neither sweep.json (a sweep or scaling run) nor metrics.jsonl (a training run)"
        )
    rows = sorted(rows, key=_order)
    return ReportData(kind, directory, [_point(r, f"P{i}", directory) for i, r in enumerate(rows, 1)], scaling)
