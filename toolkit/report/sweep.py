"""`parakit sweep`: every point of a Hydra multirun grid validated, trained for a short profiling
run, measured, and recorded beside the planner's prediction in SWEEP_DIR/sweep.csv and sweep.json.

A point is one Hydra job (`hydra.sweep.dir`/`hydra.job.num`). Invalid points are recorded with
their rules and never start (a layout predicted not to fit is invalid unless checks.memory=warn).
A valid point trains in a subprocess (torchrun, as `parakit train` starts it) under a time limit;
its exit is classified ok / out_of_memory / failed / timed_out, with the last lines of its log,
and a failure never stops the sweep. Rows are rewritten as points finish (under a file lock, so
jobs of a Slurm array can share the directory), and a point already recorded is skipped when the
same sweep runs again.
"""

from __future__ import annotations

import csv
import dataclasses
import fcntl
import io
import json
import re
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from toolkit.config.schema import Config
from toolkit.plan.layout import Layout, resolve
from toolkit.plan.memory import GIB, peak_memory
from toolkit.plan.parallel_dims import DIMS
from toolkit.plan.perf import estimate_step

_BEFORE_DIMS = (
    "point",
    "status",
    "backend",
)
_AFTER_DIMS = (
    "zero",
    "micro_batch",
    "recompute",
    "precision",
    "world_size",
    "step_time_s",
    "tokens_per_s",
    "tflops_per_gpu",
    "mfu",
    "memory_gib",
    "rss_gib",
    "final_loss",
    "predicted_step_time_s",
    "predicted_tokens_per_s",
    "predicted_memory_gib",
    "predicted_all_to_all_share",
    "seconds",
    "run_dir",
    "error",
)


def columns() -> tuple[str, ...]:
    """sweep.csv's columns: the point, its layout (every parallel dimension), its figures."""
    return (*_BEFORE_DIMS, *(d.name for d in DIMS), *_AFTER_DIMS)


FINISHED = ("ok", "out_of_memory", "failed", "timed_out", "invalid")
OOM_SIGNS = ("CUDA out of memory", "OutOfMemoryError", "out of memory", "Cannot allocate memory")


@dataclass
class SweepOptions:
    warmup_steps: int = 2  # steps left out of the timing (start-up, first allocations)
    timeout_s: float = 900.0  # a point that runs longer is stopped and recorded as timed_out
    total_points: int | None = None  # for the progress line
    started: float = 0.0  # time.time() when the sweep started


def point_dir(overrides: list[str] | str) -> str:
    """A point's run directory name: a digest of its overrides (as Hydra's override_dirname joins
    them), so the same point keeps its directory in a re-run or in another grid over the same
    sweep directory (Hydra's default, the job number, would hand one point's directory to another)."""
    import hashlib

    if not isinstance(overrides, str):
        overrides = ",".join(sorted(o for o in overrides if not o.startswith("hydra.")))
    return "point-" + hashlib.sha1(overrides.encode()).hexdigest()[:10]


def register_point_dirs() -> None:
    """`${point_dir:${hydra.job.override_dirname}}` for hydra.sweep.subdir."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("point_dir"):
        OmegaConf.register_new_resolver("point_dir", lambda joined: point_dir(str(joined)))


def point_key(overrides: list[str]) -> str:
    """The point's own overrides, sorted: the same point has the same key in a re-run."""
    return " ".join(sorted(o for o in overrides if not o.startswith("hydra.")))


def _layout_fields(cfg: Config, layout: Layout | None) -> dict:
    lay = layout
    return {
        "backend": str(cfg.backend.name),
        **{d.name: getattr(lay.dims if lay else cfg.parallel, d.name) for d in DIMS},
        "zero": cfg.zero.stage,
        "micro_batch": cfg.train.micro_batch,
        "recompute": str(cfg.recompute.granularity),
        "precision": str(cfg.precision.dtype),
        "world_size": lay.world_size if lay else None,
    }


def _predicted(cfg: Config, layout: Layout) -> dict:
    step = estimate_step(cfg, layout)
    return {
        "predicted_step_time_s": step.step_time,
        "predicted_tokens_per_s": step.tokens_per_s,
        # compared with what tensors held at the peak (the allocator's or the profiler's figure)
        "predicted_memory_gib": peak_memory(cfg, layout).tensors / GIB,
        # the MoE layers' token all-to-all, of the predicted step (0 for a dense model)
        "predicted_all_to_all_share": step.all_to_all_share,
    }


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records; a line that is not JSON (the torn last line of a killed
    run) is left out."""
    log = run_dir / "metrics.jsonl"
    records = []
    for line in log.read_text().splitlines() if log.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def loss_curve(run_dir: Path) -> dict[int, float]:
    """step -> training loss, from the run's metrics.jsonl."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def lr_curve(run_dir: Path) -> dict[int, float]:
    """step -> learning rate, from the run's metrics.jsonl."""
    return {r["step"]: r["lr"] for r in read_metrics(run_dir) if "lr" in r}


def read_result(run_dir: Path) -> dict:
    """The run's result.json (a finished run's summary); {} when there is none or it is torn."""
    path = run_dir / "result.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}


def measured(run_dir: Path, warmup_steps: int) -> dict:
    """Medians over the steps after the warm-up (all steps when the run is shorter) and the last
    loss, from the run's metrics.jsonl; peak memory and the time each pipeline stage computes from
    every rank's figures in result.json (toolkit.train.probe), where the run finished.
    memory_gib is the most any rank's tensors held (GPU: the allocator's peak; CPU: profiled
    tensor bytes), what the planner predicts; rss_gib the largest resident set (CPU)."""
    from toolkit.train.probe import stage_times

    records = [r for r in read_metrics(run_dir) if "loss" in r]
    if not records:
        return {}
    timed = records[warmup_steps:] or records

    def median(key):
        return statistics.median(r[key] for r in timed)

    figures = {
        "step_time_s": median("step_time_s"),
        "tokens_per_s": median("tokens_per_s"),
        "tflops_per_gpu": median("tflops_per_gpu"),
        "mfu": median("mfu"),
        "memory_gib": None,
        "rss_gib": None,
        "final_loss": records[-1]["loss"],
        "timed_steps": len(timed),
    }
    result = read_result(run_dir)
    ranks = result.get("ranks")
    if ranks:
        pp = 1 + max(r["stage"] for r in ranks)
        figures |= {
            "memory_gib": result.get("tensor_peak_gib"),
            "rss_gib": result.get("peak_rss_gib"),
            "stage_times_s": stage_times(ranks, pp, warmup_steps),
        }
    return figures


def _status(returncode: int | None, log_tail: str) -> str:
    if returncode is None:
        return "timed_out"
    if returncode == 0:
        return "ok"
    return "out_of_memory" if any(sign in log_tail for sign in OOM_SIGNS) else "failed"


def _train(cfg: Config, layout: Layout, run_dir: Path, timeout_s: float) -> tuple[int | None, str]:
    """Train the point in its own process group (torchrun for every world size: a crash or a
    hang stays there); (exit code or None on timeout, the log's last lines)."""
    from toolkit.train.stop import run_group
    from toolkit.train.torchrun import torchrun_command, torchrun_env

    env = torchrun_env(cfg)
    command = torchrun_command(run_dir, layout.world_size, cfg.train.fault.max_restarts)
    log = run_dir / "train.log"
    # torchrun starts each rank in a session of its own (torch/distributed/elastic/multiprocessing/
    # subprocess_handler): on a timeout, SIGTERM makes torchrun stop its ranks (toolkit.train.stop)
    with open(log, "w") as out:
        code = run_group(command, env=env, stdout=out, timeout_s=timeout_s)
    return code, error_summary(log.read_text(errors="replace").splitlines())


# A raised exception's last traceback line ("[rank1]: ValueError: ..."), torchrun's own
# ChildFailedError (which only says a child failed) left out.
EXCEPTION_LINE = re.compile(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Interrupt)\b.*")


def error_summary(lines: list[str], tail: int = 12) -> str:
    """The first rank's exception line, then the log's last lines (torchrun ends its log with a
    summary that names the failed rank but not the cause)."""
    causes = [ln.strip() for ln in lines if EXCEPTION_LINE.match(ln.strip()) and "ChildFailedError" not in ln]
    last = "\n".join(lines[-tail:])
    return f"{causes[0]}\n...\n{last}" if causes and causes[0] not in last else last


@contextmanager
def _locked(sweep_dir: Path):
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with open(sweep_dir / ".sweep.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class SweepRecordError(ValueError):
    """A sweep.json that is not a sweep's record: the file and what is wrong with it."""


def _read(sweep_dir: Path) -> dict:
    path = Path(sweep_dir) / "sweep.json"
    if not path.exists():
        return {"points": []}
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SweepRecordError(f"{path} cannot be read as JSON ({e}); move it away to start the sweep again") from None
    points = document.get("points") if isinstance(document, dict) else None
    if not isinstance(points, list) or not all(isinstance(r, dict) and "point" in r for r in points):
        raise SweepRecordError(
            f"{path} is not a sweep's record (an object whose points are rows with a point each); "
            "move it away to start the sweep again"
        )
    return document


def read_rows(sweep_dir: Path) -> list[dict]:
    return _read(sweep_dir)["points"]


def describe_sweep(sweep_dir: Path, **fields) -> None:
    """Set top-level fields of sweep.json beside its points (a scaling run's "scaling" block)."""
    from toolkit.formats.atomic import write_atomic

    with _locked(sweep_dir):
        write_atomic(sweep_dir / "sweep.json", json.dumps(_read(sweep_dir) | fields, indent=2) + "\n")


def record(sweep_dir: Path, row: dict) -> None:
    """Add or replace the point's row; sweep.json and sweep.csv rewritten atomically."""
    from toolkit.formats.atomic import write_atomic

    with _locked(sweep_dir):
        document = _read(sweep_dir)
        rows = [r for r in document["points"] if r["point"] != row["point"]] + [row]
        write_atomic(sweep_dir / "sweep.json", json.dumps(document | {"points": rows}, indent=2) + "\n")
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=columns(), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        write_atomic(sweep_dir / "sweep.csv", text.getvalue())


def run_point(cfg: Config, overrides: list[str], run_dir: Path, sweep_dir: Path, opts: SweepOptions) -> dict:
    """Validate, train and measure one point; its row (also recorded)."""
    from toolkit.config.machine import cuda_gpus
    from toolkit.emit.files import write_run_files
    from toolkit.plan.validate import validate

    key = point_key(overrides)
    done = {r["point"]: r for r in read_rows(sweep_dir)}
    if done.get(key, {}).get("status") in FINISHED:
        return {**done[key], "skipped": True}
    started = time.monotonic()
    report = validate(cfg, gpus=cuda_gpus())  # its ranks start here
    row = {"point": key, "run_dir": str(run_dir)}
    if not report.ok:
        row |= _layout_fields(cfg, None) | {"status": "invalid", "error": "; ".join(map(str, report.errors))}
    else:
        layout = resolve(cfg)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, profile_memory=True))  # tensor bytes on CPU
        write_run_files(cfg, layout, run_dir)
        code, tail = _train(cfg, layout, run_dir, opts.timeout_s)
        status = _status(code, tail)
        row |= _layout_fields(cfg, layout) | _predicted(cfg, layout) | measured(run_dir, opts.warmup_steps)
        row |= {"status": status, "error": "" if status == "ok" else tail}
    row["seconds"] = time.monotonic() - started
    record(sweep_dir, row)
    return row


def progress_line(row: dict, done: int, opts: SweepOptions) -> str:
    elapsed = time.time() - opts.started  # wall clock: a Slurm job compares it with the submitting host's
    total = opts.total_points
    left = f", {total - done} left" if total else ""
    eta = f", about {elapsed / done * (total - done):.0f} s to go" if total and done else ""
    what = "skipped (recorded before)" if row.get("skipped") else row["status"]
    figures = f": {row['tokens_per_s']:,.0f} tokens/s" if row.get("tokens_per_s") else ""
    count = f"{done}/{total}" if total else f"{done}"
    return f"sweep point {count} [{row['point']}] {what}{figures} ({elapsed:.0f} s elapsed{left}{eta})"


def grid_size(arguments: list[str]) -> int | None:
    """How many points the sweep makes: the product of the grid's values for Hydra's basic
    sweeper, hydra.sweeper.n_trials for another sweeper (Optuna), None when unknown."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    settings = dict(a.split("=", 1) for a in arguments if "=" in a and not a.startswith("-"))
    if settings.get("hydra/sweeper", "basic") != "basic":
        trials = settings.get("hydra.sweeper.n_trials")
        return int(trials) if trials and trials.isdigit() else None
    try:
        overrides = OverridesParser.create().parse_overrides(
            [a for a in arguments if "=" in a and not a.startswith("-")]
        )
    except Exception:  # Hydra reports the bad override itself when it composes
        return None
    size = 1
    for o in overrides:
        if o.is_sweep_override():
            size *= len(list(o.sweep_string_iterator()))
    return size


GRID_CHECKED = 64  # points composed and validated before a sweep starts (0.13 s each); past it, the first only


def grid_points(arguments: list[str]) -> list[list[str]] | None:
    """Each point's overrides of a basic-sweeper grid (`a=1,2 b=x` -> [a=1 b=x], [a=2 b=x]), Hydra's
    own overrides left out; None for another sweeper or an override Hydra will report itself."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [a for a in arguments if "=" in a and not a.startswith(("-", "hydra.", "hydra/"))]
    if any(a.startswith("hydra/sweeper=") and not a.endswith("=basic") for a in arguments):
        return None
    try:
        parsed = OverridesParser.create().parse_overrides(given)
    except Exception:
        return None
    choices = [
        [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [text]
        for o, text in zip(parsed, given)
    ]
    return [list(point) for point in itertools.product(*choices)]


def errors_in_every_point(arguments: list[str], config_dirs) -> list:
    """The validator's errors that every point of the grid has (up to GRID_CHECKED points): what no
    point of the sweep can escape, refused before any point starts."""
    from toolkit.config.store import compose_config
    from toolkit.plan.validate import validate

    points = grid_points(arguments)
    if not points:
        return []
    common = None
    for point in points if len(points) <= GRID_CHECKED else points[:1]:
        try:
            errors = {str(e): e for e in validate(compose_config(point, config_dirs), memory=False).errors}
        except Exception:  # a composition error: Hydra reports it with the point
            return []
        common = errors if common is None else {k: v for k, v in common.items() if k in errors}
        if not common:
            return []
    return list(common.values())


def main_sweep_summary(sweep_dir: Path) -> str:
    rows = read_rows(sweep_dir)
    counts = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    listing = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    return f"sweep: {len(rows)} point(s) in {sweep_dir}/sweep.csv ({listing})"
