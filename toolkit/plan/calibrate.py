"""Fitting the cluster's efficiency constants to a measured sweep (`parakit calibrate`, whose I/O is
toolkit.report.calibrate).

The planner's step time (toolkit/plan/perf.py) depends on a handful of cluster constants: the
fraction of peak a large GEMM reaches, the link bandwidths, the device-memory bandwidth that
element-wise work runs at, and a fixed per-step overhead (framework, Python, optimizer launch).
Datasheet values describe the hardware, not the software stack on it; measured points pin them
down. The fit minimises the squared log error of predicted over measured step time
(scipy.optimize.least_squares, trust-region reflective, constants kept positive by fitting their
logarithms), so a point 2x too slow weighs as much as one 2x too fast.

The error before and after is judged on points held out of the fit: each point is predicted by
a fit to all the others (leave-one-out cross-validation, Stone 1974), and the cluster written
out is fitted to every point.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from toolkit.config.schema import ClusterConfig, Config
from toolkit.plan.layout import Layout
from toolkit.plan.perf import estimate_step

# The constants a sweep can inform, in the order a report lists them.
CONSTANTS = (
    "gemm_efficiency",
    "gemm_half_size",
    "hbm_bandwidth_gbs",
    "intra_node_bandwidth_gbs",
    "inter_node_bandwidth_gbs",
    "step_overhead_s",
    "layer_overhead_s",
)
# A constant whose doubling moves no prediction by this much is not fitted (no point exercises
# it: inter-node bandwidth on a one-node sweep).
SENSITIVITY = 1e-3
# A constant joins the fit when it lowers the median held-out error by this much (absolute).
IMPROVEMENT = 0.005
# How far from its starting value a fit may move a constant (either way).
SPAN = 1000.0


class CalibrationError(ValueError):
    pass


@dataclass(frozen=True)
class Point:
    name: str
    cfg: Config
    layout: Layout
    measured: float  # median step time, seconds


@dataclass(frozen=True)
class Calibration:
    datasheet: ClusterConfig  # as the sweep ran
    cluster: ClusterConfig  # fitted to every point
    fitted: tuple[str, ...]  # the constants the points informed
    points: tuple[Point, ...]
    before: tuple[float, ...]  # relative error per point, datasheet cluster
    after: tuple[float, ...]  # relative error per point, fit without that point (held out)

    @property
    def median_before(self) -> float:
        return statistics.median(map(abs, self.before))

    @property
    def median_after(self) -> float:
        return statistics.median(map(abs, self.after))


def predict(point: Point, constants: dict[str, float]) -> float:
    """The planner's step time for the point with these constants in its own cluster (its
    topology, gpus_per_node and nodes, is the point's)."""
    cluster = dataclasses.replace(point.cfg.cluster, **constants)
    return estimate_step(dataclasses.replace(point.cfg, cluster=cluster), point.layout).step_time


def _relative_errors(points, constants_of) -> tuple[float, ...]:
    """(predicted - measured) / measured per point; constants_of(i) are the constants for point i."""
    return tuple((predict(p, constants_of(i)) - p.measured) / p.measured for i, p in enumerate(points))


def _informed(points: list[Point], datasheet: dict[str, float]) -> tuple[str, ...]:
    """The constants that move some prediction (doubled: by SENSITIVITY or more)."""
    base = [predict(p, datasheet) for p in points]
    names = []
    for name in CONSTANTS:
        doubled = datasheet | {name: 2 * (datasheet[name] or _start(name, points))}
        if any(abs(predict(p, doubled) / b - 1) > SENSITIVITY for p, b in zip(points, base)):
            names.append(name)
    return tuple(names)


def _start(name: str, points: list[Point]) -> float:
    """Where an overhead the datasheet leaves at 0 starts: a tenth of the median step, spread over
    the layers and micro-batches of a step for the per-layer one."""
    step = statistics.median(p.measured for p in points)
    if name == "layer_overhead_s":
        return 0.1 * step / statistics.median(p.layout.num_microbatches * max(p.layout.stage_layers) for p in points)
    return 0.1 * step


def _held_out(points: list[Point], datasheet: dict[str, float], names: tuple[str, ...]) -> tuple[float, ...]:
    fits = [fit(points[:i] + points[i + 1 :], datasheet, names) for i in range(len(points))]
    return _relative_errors(points, fits.__getitem__)


def select(points: list[Point], datasheet: dict[str, float]) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """Forward selection by held-out error: add the informed constant that lowers the median
    held-out error most, while one does (each constant fitted to few points fits their noise);
    (the constants, their held-out errors)."""
    chosen: tuple[str, ...] = ()
    errors = _relative_errors(points, lambda i: datasheet)
    candidates = list(_informed(points, datasheet))
    while candidates:
        trials = {name: _held_out(points, datasheet, (*chosen, name)) for name in candidates}
        best = min(trials, key=lambda n: statistics.median(map(abs, trials[n])))
        if statistics.median(map(abs, trials[best])) >= statistics.median(map(abs, errors)) - IMPROVEMENT:
            break
        chosen, errors = (*chosen, best), trials[best]
        candidates.remove(best)
    return chosen, errors


def fit(points: list[Point], datasheet: dict[str, float], names: tuple[str, ...]) -> dict[str, float]:
    """The constants with `names` fitted to the points (least squares on log step time)."""
    import numpy as np
    from scipy.optimize import least_squares

    start = np.log([datasheet[n] or _start(n, points) for n in names])
    # A constant the points barely inform stays within SPAN of where it started (a fit would
    # otherwise push an unused bandwidth to infinity); an efficiency is at most 1.
    lower = start - math.log(SPAN)
    upper = np.array([min(0.0, s) if n == "gemm_efficiency" else s for n, s in zip(names, start + math.log(SPAN))])

    def constants(x):
        return datasheet | dict(zip(names, map(float, np.exp(x))))

    def residuals(x):
        return [math.log(predict(p, constants(x)) / p.measured) for p in points]

    x0 = np.clip(start, lower, upper - 1e-9)
    return constants(least_squares(residuals, x0, bounds=(lower, upper), method="trf").x)


def calibrate(points: list[Point]) -> Calibration:
    if len(points) < 3:
        raise CalibrationError(
            f"{len(points)} measured point(s); calibration needs at least 3 (one held out, two to fit): "
            "sweep more layouts"
        )
    # The written cluster is the largest point's (its gpus_per_node and nodes) with fitted constants.
    largest = max(points, key=lambda p: p.layout.world_size).cfg.cluster
    datasheet = {n: getattr(largest, n) for n in CONSTANTS}
    names, after = select(points, datasheet)
    return Calibration(
        datasheet=largest,
        cluster=dataclasses.replace(largest, **fit(points, datasheet, names)),
        fitted=names,
        points=tuple(points),
        before=_relative_errors(points, lambda i: datasheet),
        after=after,
    )


def cluster_yaml(calibration: Calibration, name: str) -> str:
    """The fitted cluster as a config-group file (`cluster=NAME`), its provenance in comments."""
    from omegaconf import OmegaConf

    c = dataclasses.replace(calibration.cluster, name=name)
    header = (
        f"# {name}: {calibration.datasheet.name} calibrated by `parakit calibrate` on "
        f"{len(calibration.points)} measured points.\n"
        f"# Fitted: {', '.join(calibration.fitted)}. Median step-time error on held-out points: "
        f"{calibration.median_before:.1%} before, {calibration.median_after:.1%} after.\n"
    )
    return header + OmegaConf.to_yaml(OmegaConf.structured(c))
