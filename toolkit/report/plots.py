"""The report's PNG plots, drawn with matplotlib's Agg canvas (no display, no pyplot state).

Each `plot_*` draws one figure from a ReportData and returns a Plot, or None when the data has
nothing for it (e.g. one world size: no doubling to judge). Legends sit outside the axes so that
they never cover a point; rank axes are log2 (one tick per doubling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator, ScalarFormatter

from toolkit.plan.doublings import Doubling, doublings, first_below
from toolkit.report.load import Point, ReportData, layout_keys

DPI = 110
MARKERS = ("o", "s", "^", "v", "D", "x", "+", "P", "*", "<", ">")
WIDE = (9.0, 4.8)
# Point labels take turns above-right, below-right, above-left and below-left (offset points) so
# that labels of nearby points do not print over each other.
LABEL_OFFSETS = ((5, 5), (5, -11), (-5, 5), (-5, -11))


@dataclass(frozen=True)
class Plot:
    name: str  # file stem: NAME.png
    title: str
    path: Path
    note: str = ""  # what the plot cannot show (shown under it on the page)
    # The drawn figure, kept for whoever reads its series, axes and labels (the tests do); None
    # for a picture copied from elsewhere (the reproduction's).
    figure: Figure | None = field(default=None, repr=False, compare=False)


def _figure(size=WIDE, panels: int = 1):
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels)
    return fig, axes


def _save(fig: Figure, out_dir: Path, name: str, title: str, note: str = "") -> Plot:
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=DPI)
    return Plot(name, title, path, note, fig)


def _legend_outside(ax, **kwargs) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", frameon=False, **kwargs)


def _label(ax, text: str, xy: tuple[float, float], turn: int) -> None:
    dx, dy = LABEL_OFFSETS[turn % len(LABEL_OFFSETS)]
    align = "left" if dx > 0 else "right"
    ax.annotate(text, xy, textcoords="offset points", xytext=(dx, dy), fontsize="x-small", ha=align)


def _ranks_axis(ax, ranks: list[int]) -> None:
    """Log2 x axis with a plain tick at every power of two between the smallest and largest."""
    low, high = min(ranks), max(ranks)
    ax.set_xscale("log", base=2)
    ticks = [2**e for e in range(int(math.floor(math.log2(low))), int(math.ceil(math.log2(high))) + 1)]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlim(low / 1.3, high * 1.3)
    ax.set_xlabel("ranks (world size, log2 scale)")


def curves(data: ReportData, key: str = "tokens_per_s") -> list[list[Point]]:
    """Measured points grouped into curves: same layout except the scaled dimension, ordered by
    world size (one point per world size: the first of equal ones)."""
    groups: dict[tuple, dict[int, Point]] = {}
    for p in data.points:
        if p.measured and p.row.get(key) and p.row.get("world_size"):
            series = tuple(p.row.get(k) for k in layout_keys() if k != data.scaled_dimension)
            groups.setdefault(series, {}).setdefault(p.row["world_size"], p)
    return [[by_ranks[w] for w in sorted(by_ranks)] for by_ranks in groups.values()]


def curve_name(curve: list[Point], dimension: str) -> str:
    """A curve's legend name: its layout with the scaled dimension shown as varying (N)."""
    return curve[0].describe(varying=dimension)


def _tokens(point: Point) -> float:
    return point.row["tokens_per_s"]


def plot_throughput(data: ReportData, out_dir: Path) -> Plot | None:
    """Measured tokens/s against ranks per curve, with the planner's prediction and the ideal
    linear line from the curve's smallest point."""
    lines = curves(data)
    if sum(map(len, lines)) < 2:  # one point says nothing about scaling (its figures are in the table)
        return None
    fig, ax = _figure()
    for i, curve in enumerate(lines):
        color = f"C{i % 10}"
        ranks = [p.row["world_size"] for p in curve]
        ax.plot(
            ranks,
            [p.row["tokens_per_s"] for p in curve],
            "o-",
            color=color,
            label=curve_name(curve, data.scaled_dimension),
        )
        base = curve[0].row
        ax.plot(ranks, [base["tokens_per_s"] * r / base["world_size"] for r in ranks], ":", color=color, alpha=0.8)
        predicted = [
            (p.row["world_size"], p.row["predicted_tokens_per_s"]) for p in curve if p.row.get("predicted_tokens_per_s")
        ]
        if predicted:
            ax.plot(*zip(*predicted), "s--", color=color, markerfacecolor="none", alpha=0.8)
    # At each world size the highest point is labelled above, the next below, ...: each label by its point.
    for ranks in {p.row["world_size"] for curve in lines for p in curve}:
        stacked = sorted((p for curve in lines for p in curve if p.row["world_size"] == ranks), key=_tokens)
        for turn, p in enumerate(reversed(stacked)):
            _label(ax, p.label, (ranks, _tokens(p)), turn)
    _ranks_axis(ax, [p.row["world_size"] for curve in lines for p in curve])
    ax.set_ylim(bottom=0)
    ax.set_ylabel("throughput (tokens/s, whole job)")
    ax.set_title(_titled("Throughput vs ranks", data))
    ax.grid(True, alpha=0.3)
    styles = [
        Line2D([], [], color="gray", marker="o", label="measured (median after warm-up)"),
        Line2D([], [], color="gray", marker="s", markerfacecolor="none", linestyle="--", label="planner's prediction"),
        Line2D([], [], color="gray", linestyle=":", label="ideal linear (from the smallest point)"),
    ]
    handles, _ = ax.get_legend_handles_labels()
    _legend_outside(ax, handles=handles + styles)
    return _save(fig, out_dir, "throughput", "Throughput vs ranks")


def _titled(what: str, data: ReportData) -> str:
    return f"{what}: {data.scaling_description}" if data.scaling else what


def gain_per_doubling(step: Doubling) -> float:
    """Throughput gain per 2x of ranks: a 4x step that gained g counts as two doublings of sqrt(g)."""
    return step.gain_per_doubling


def per_doubling(step: Doubling) -> float:
    """Efficiency per doubling: the gain per doubling over the ideal 2x."""
    return gain_per_doubling(step) / 2


def plot_efficiency(data: ReportData, out_dir: Path) -> Plot | None:
    """Scaling efficiency of each doubling (gain over the ideal 2x), with the threshold line."""
    steps_per_curve = [(curve, doublings([p.row for p in curve], data.threshold)) for curve in curves(data)]
    steps_per_curve = [(c, s) for c, s in steps_per_curve if s]
    if not steps_per_curve:
        return None
    fig, ax = _figure()
    limit = data.threshold / 2
    for i, (curve, steps) in enumerate(steps_per_curve):
        color = f"C{i % 10}"
        ranks = [s.to_ranks for s in steps]
        ax.plot(
            ranks,
            [100 * per_doubling(s) for s in steps],
            "o-",
            color=color,
            label=curve_name(curve, data.scaled_dimension),
        )
        for s in steps:
            ax.annotate(
                f"{gain_per_doubling(s):.2f}x per 2x",
                (s.to_ranks, 100 * per_doubling(s)),
                textcoords="offset points",
                xytext=(9, 7),  # clear of the ring that marks the first doubling under the threshold
                fontsize="x-small",
            )
        stop = first_below(steps)
        if stop is not None:
            ax.plot(
                [stop.to_ranks], [100 * per_doubling(stop)], "o", markersize=15, markerfacecolor="none", color="red"
            )
    ax.axhline(100, color="gray", linewidth=1)
    ax.axhline(100 * limit, color="red", linestyle="--", linewidth=1)
    _ranks_axis(ax, [s.to_ranks for _, steps in steps_per_curve for s in steps])
    ax.set_xlabel("ranks after the doubling (world size, log2 scale)")
    ax.set_ylabel("scaling efficiency per doubling (%)")
    shown = [100 * per_doubling(s) for _, steps in steps_per_curve for s in steps]
    ax.set_ylim(min(0, min(shown) - 10), max(115, max(shown) + 15))  # superlinear steps stay in view
    ax.set_title(_titled("Efficiency per doubling", data))
    ax.grid(True, alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    marks = [
        Line2D([], [], color="gray", label="ideal: 2x throughput per 2x ranks"),
        Line2D([], [], color="red", linestyle="--", label=f"threshold {data.threshold:g}x per 2x ({100 * limit:.0f}%)"),
        Line2D(
            [], [], color="red", marker="o", markerfacecolor="none", linestyle="none", label="first doubling under it"
        ),
    ]
    _legend_outside(ax, handles=handles + marks)
    return _save(fig, out_dir, "efficiency", "Efficiency per doubling")


def _plain_log_axes(ax) -> None:
    """Log-log, ticks at 1, 2 and 5 per decade written as plain numbers (0.5, not 5x10^-1)."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.set_minor_formatter(NullFormatter())


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """The planner's error on a point: (predicted - measured) / measured."""
    if not predicted or not measured:
        return None
    return (predicted - measured) / measured


def plot_predicted_vs_measured(data: ReportData, out_dir: Path) -> Plot | None:
    """Step time and peak memory: each measured point against its prediction, on y = x."""
    panels = (
        ("step_time_s", "predicted_step_time_s", "step time (s)"),
        ("memory_gib", "predicted_memory_gib", "peak tensor memory, busiest rank (GiB)"),
    )
    measured_points = [p for p in data.points if p.measured]
    if not measured_points:
        return None
    fig, axes = _figure((11.0, 5.0), panels=2)
    for ax, (key, predicted_key, what) in zip(axes, panels):
        pairs = [
            (p, p.row[predicted_key], p.row[key])
            for p in measured_points
            if p.row.get(predicted_key) and p.row.get(key)
        ]
        if not pairs:
            ax.text(0.5, 0.5, "no predictions recorded", ha="center", transform=ax.transAxes)
            continue
        values = [v for _, x, y in pairs for v in (x, y)]
        low, high = min(values) / 1.5, max(values) * 1.5
        ax.plot([low, high], [low, high], color="gray", linewidth=1, label="y = x (prediction exact)")
        for i, (p, x, y) in enumerate(pairs):
            ax.plot([x], [y], "o", color="C0")
            _label(ax, f"{p.label} {relative_error(x, y):+.0%}", (x, y), i)
        _plain_log_axes(ax)
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
        ax.set_aspect("equal")
        ax.set_xlabel(f"planner's prediction: {what}")
        ax.set_ylabel(f"measured: {what}")
        ax.set_title(f"{what.split(' (')[0].capitalize()}: predicted vs measured")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper left", fontsize="small", frameon=False)
    fig.suptitle(
        "Planner vs measurement (label: point, planner error = (predicted - measured) / measured)", fontsize="medium"
    )
    return _save(fig, out_dir, "predicted_vs_measured", "Predicted vs measured step time and peak memory")


def plot_losses(data: ReportData, out_dir: Path) -> Plot | None:
    """Every point's training loss per step (validation losses as hollow markers), overlaid."""
    with_losses = [p for p in data.points if p.losses]
    if not with_losses:
        return None
    fig, ax = _figure()
    for i, p in enumerate(with_losses):
        color = f"C{i % 10}"
        # Layouts that agree draw the same curve: a marker of its own keeps each one visible.
        marker = MARKERS[i % len(MARKERS)] if len(p.losses) <= 60 else None
        status = "" if p.row.get("status") == "ok" else f" ({p.row.get('status')})"  # a curve that stops early
        label = f"{p.label} {p.layout}{status}"
        ax.plot(*zip(*p.losses), "-", marker=marker, markerfacecolor="none", color=color, label=label)
        if p.val_losses:
            ax.plot(*zip(*p.val_losses), "o--", color=color, markerfacecolor="none")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy, nats/token)")
    ax.set_title(_titled("Loss curves", data))
    ax.grid(True, alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    handles, _ = ax.get_legend_handles_labels()
    if any(p.val_losses for p in with_losses):
        handles.append(
            Line2D([], [], color="gray", marker="o", markerfacecolor="none", linestyle="--", label="validation loss")
        )
    _legend_outside(ax, handles=handles)
    return _save(fig, out_dir, "loss", "Loss curves")


NO_STAGE_MEASUREMENT = "measured per-stage times: not recorded by these runs (result.json has no stage_times_s)"


def plot_stage_times(data: ReportData, out_dir: Path) -> Plot | None:
    """Pipeline layouts: seconds each stage computes per step, predicted (and measured where a run
    recorded it); the slowest stage sets the pipeline's pace, so even bars are the goal."""
    piped = [p for p in data.points if p.predicted_stage_times]
    if not piped:
        return None
    fig, ax = _figure()
    recorded = any(p.measured_stage_times for p in piped)
    bars_per_point = 2 if recorded else 1
    width = 0.8 / (len(piped) * bars_per_point)  # a stage's bars share 0.8 of its slot, centred on it
    for i, p in enumerate(piped):
        color = f"C{i % 10}"
        times = p.predicted_stage_times
        balance = max(times) / (sum(times) / len(times))
        offset = -0.4 + (i * bars_per_point + 0.5) * width
        xs = [stage + offset for stage in range(len(times))]
        ax.bar(xs, times, width, color=color, label=f"{p.label} {p.layout} (slowest / mean {balance:.2f})")
        if p.measured_stage_times:
            ax.bar([x + width for x in xs], p.measured_stage_times, width, color=color, hatch="//", alpha=0.6)
    stages = max(len(p.predicted_stage_times) for p in piped)
    ax.set_xticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("compute time per step (s, forward + backward)")
    ax.set_title("Time per pipeline stage (planner)" + (" and measured" if recorded else ""))
    ax.grid(True, axis="y", alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    handles.append(Line2D([], [], color="gray", linewidth=8, label="planner's prediction"))
    if recorded:
        handles.append(Line2D([], [], color="gray", linewidth=8, alpha=0.6, label="measured (hatched)"))
    _legend_outside(ax, handles=handles)
    note = "" if recorded else NO_STAGE_MEASUREMENT
    if note:
        fig.text(0.01, 0.01, note, fontsize="small", color="dimgray")
        fig.get_layout_engine().set(rect=(0, 0.05, 1, 0.95))
    return _save(fig, out_dir, "stage_times", "Time per pipeline stage", note)


# Each plot, and what it needs when the data has nothing for it (said on the page instead).
PLOTTERS = (
    (plot_throughput, "throughput vs ranks: needs two or more measured points"),
    (plot_efficiency, "efficiency per doubling: needs measured points at two or more world sizes of one layout"),
    (plot_predicted_vs_measured, "predicted vs measured: needs a measured point"),
    (plot_losses, "loss curves: no point has a metrics.jsonl with losses"),
    (plot_stage_times, "time per pipeline stage: no valid pipeline layout (pp > 1) with its config.yaml"),
)


def _figure_text(f: dict) -> str:
    measured = "none" if f["measured"] is None else f"{f['measured']:,.4g}"
    return f"{f['name']} {measured} {f['unit']} against {f['expected']:,.4g} ({'ok' if f['pass'] else 'FAIL'})"


def reproduction(data: ReportData, out_dir: Path) -> Plot | None:
    """A run `parakit reproduce` compared with its baseline: its curve over the golden band (the
    PNG reproduce wrote), the verdict under it."""
    import json
    import shutil

    for point in data.points:
        run_dir = Path(point.row.get("run_dir") or data.directory)
        result, picture = run_dir / "reproduce.json", run_dir / "reproduce.png"
        if result.is_file() and picture.is_file():
            found = json.loads(result.read_text())
            loss = found["loss"]
            figures = "; ".join(_figure_text(f) for f in found["figures"])
            note = (
                f"{'PASS' if found['pass'] else 'FAIL'} against the baseline of {found['recipe']}: the loss at "
                f"{len(loss['steps'])} step(s), max deviation {loss['max_deviation']:.2e} "
                f"(tolerance {loss['tolerance']:g})"
                + (f"; {figures}" if figures else "")
                + "".join(f"; {n}" for n in found["notes"])
            )
            target = out_dir / "reproduce.png"
            shutil.copyfile(picture, target)
            return Plot("reproduce", f"Reproduction of {found['recipe']} against its baseline", target, note)
    return None


def draw(data: ReportData, out_dir: Path) -> tuple[list[Plot], list[str]]:
    """Every plot the data has something for, written as OUT_DIR/NAME.png; and for each plot left
    out, what it needs. A reproduced run's comparison with its baseline comes last, where there is one."""
    plots, missing = [], []
    for plotter, needs in PLOTTERS:
        plot = plotter(data, out_dir)
        if plot is None:
            missing.append(needs)
        else:
            plots.append(plot)
    compared = reproduction(data, out_dir)
    return plots + ([compared] if compared else []), missing
