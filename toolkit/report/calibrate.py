"""`parakit calibrate SWEEP_DIR`: the sweep's measured points in (its sweep.json and the run
directories' configurations), the fitted cluster file and the report out. The fit itself is
arithmetic, in toolkit.plan.calibrate."""

from __future__ import annotations

import sys
from pathlib import Path

from toolkit.config.schema import as_name
from toolkit.config.store import load_run_config
from toolkit.formats.atomic import write_atomic
from toolkit.plan.calibrate import Calibration, CalibrationError, Point, calibrate, cluster_yaml
from toolkit.plan.layout import resolve
from toolkit.report.sweep import SweepRecordError, read_rows


def load_points(sweep_dir: Path) -> list[Point]:
    """The sweep's measured points (status ok), each with the configuration it trained."""
    try:
        rows = read_rows(sweep_dir)
    except SweepRecordError as e:
        raise CalibrationError(str(e)) from None
    if not rows:
        raise CalibrationError(f"{sweep_dir}: no sweep.json; run `parakit sweep ... hydra.sweep.dir={sweep_dir}` first")
    points = []
    for row in rows:
        if row.get("status") != "ok" or not row.get("step_time_s"):
            continue
        try:
            cfg = load_run_config(Path(row["run_dir"]))
        except Exception as e:  # moved, deleted or damaged: name the point, not a traceback
            raise CalibrationError(
                f"{sweep_dir}: point {row['point']}: its run {row.get('run_dir')} cannot be read "
                f"({type(e).__name__}: {e}); run the point again or remove its row"
            ) from None
        points.append(Point(row["point"], cfg, resolve(cfg), float(row["step_time_s"])))
    clusters = {p.cfg.cluster.name for p in points}
    if len(clusters) > 1:
        raise CalibrationError(
            f"{sweep_dir}: points on clusters {sorted(clusters)}; calibrate one cluster at a time "
            "(a sweep over one cluster option)"
        )
    return points


def report(calibration: Calibration) -> str:
    before, after = calibration.datasheet, calibration.cluster
    lines = [f"{'constant':<26}{'before':>12}{'after':>12}"]
    lines += [f"{n:<26}{getattr(before, n):>12.4g}{getattr(after, n):>12.4g}" for n in calibration.fitted]
    lines += ["", f"{'point':<60}{'measured s':>11}{'before':>9}{'after':>9}"]
    for p, b, a in zip(calibration.points, calibration.before, calibration.after):
        lines.append(f"{p.name[:59]:<60}{p.measured:>11.4f}{b:>+9.1%}{a:>+9.1%}")
    lines += [
        "",
        f"median step-time error on held-out points (each predicted by a fit to the others): "
        f"{calibration.median_before:.1%} before, {calibration.median_after:.1%} after calibration",
    ]
    return "\n".join(lines)


def run_calibrate(opts) -> int:
    sweep_dir = Path(opts.sweep_dir)
    try:
        calibration = calibrate(load_points(sweep_dir))
    except CalibrationError as e:
        print(f"parakit calibrate: {e}", file=sys.stderr)
        return 1
    name = opts.name or as_name(f"{calibration.datasheet.name}_calibrated")
    config_dir = Path(opts.output) if opts.output else sweep_dir / "calibrated"
    target = config_dir / "cluster" / f"{name}.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, cluster_yaml(calibration, name))
    print(report(calibration))
    print(f"\nwrote {target}\nuse it: parakit plan --config-dir {config_dir} cluster={name} ...")
    return 0
