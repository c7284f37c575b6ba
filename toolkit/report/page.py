"""`parakit report DIR`: the plots, one self-contained HTML page (plots embedded as data URIs, the
table of points, failed and invalid points with their errors) and report.md (the same table).

    parakit report SWEEP_DIR | SCALING_DIR | RUN_DIR [--output OUT]   (default OUT: DIR/report)
"""

from __future__ import annotations

import base64
import html
import sys
from collections import Counter
from pathlib import Path
from typing import Callable

from toolkit.plan.doublings import doublings, first_below
from toolkit.plan.parallel_dims import DIMS
from toolkit.report.load import NotAReportDir, Point, ReportData, load
from toolkit.report.plots import Plot, curve_name, curves, draw, per_doubling, relative_error


def _number(value, digits: int = 3) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}g}"
    return str(value)


def _field(key: str, digits: int = 3) -> Callable[[Point], str]:
    return lambda point: _number(point.row.get(key), digits)


def _error_pct(point: Point, key: str) -> str:
    error = relative_error(point.row.get(f"predicted_{key}"), point.row.get(key))
    return "" if error is None else f"{error:+.0%}"


def _first_line(error: str | None) -> str:
    """The most telling line of a recorded error (the log's last non-empty one), shortened."""
    lines = [line.strip() for line in (error or "").splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    return text if len(text) <= 120 else text[:117] + "..."


def table() -> tuple[tuple[str, Callable[[Point], str]], ...]:
    """The table's columns: header, cell of a point (one table for the page and the Markdown)."""
    return (
        ("point", lambda p: p.label),
        ("status", lambda p: p.row.get("status", "")),
        ("backend", lambda p: p.row.get("backend", "")),
        *((d.name, _field(d.name)) for d in DIMS),
        ("zero", _field("zero")),
        ("micro batch", _field("micro_batch")),
        ("ranks", _field("world_size")),
        ("step time s", _field("step_time_s")),
        ("predicted s", _field("predicted_step_time_s")),
        ("step time error", lambda p: _error_pct(p, "step_time_s")),
        ("tokens/s", _field("tokens_per_s")),
        ("predicted tokens/s", _field("predicted_tokens_per_s")),
        (
            "predicted all-to-all",
            lambda p: f"{p.row['predicted_all_to_all_share']:.0%}" if p.row.get("predicted_all_to_all_share") else "",
        ),
        ("TFLOP/s per rank", _field("tflops_per_gpu")),
        ("MFU", lambda p: f"{p.row['mfu']:.1%}" if p.row.get("mfu") else ""),
        ("memory GiB", _field("memory_gib")),
        ("predicted GiB", _field("predicted_memory_gib")),
        ("memory error", lambda p: _error_pct(p, "memory_gib")),
        ("RSS GiB", _field("rss_gib")),
        ("final loss", _field("final_loss", digits=5)),
        ("error", lambda p: _first_line(p.row.get("error"))),
    )


ERRORS_MEAN = (
    "The error columns are the planner's: (predicted - measured) / measured. Memory is the most bytes "
    "tensors held on any rank (the GPU allocator's peak; on CPU profiled), what the planner predicts; "
    "RSS is the largest resident set (CPU), which also holds the interpreter and the libraries."
)


def scaling_summary(data: ReportData) -> list[str]:
    """One line per curve with doublings: each doubling's gain, and where it fell under the threshold."""
    lines = []
    for curve in curves(data):
        steps = doublings([p.row for p in curve], data.threshold)
        if not steps:
            continue
        gains = ", ".join(
            f"{s.from_ranks}->{s.to_ranks}: {s.gain:.2f}x ({per_doubling(s):.0%} per doubling)" for s in steps
        )
        stop = first_below(steps)
        verdict = (
            f"first under {data.threshold:g}x per 2x at {stop.from_ranks}->{stop.to_ranks} ranks: scale no further"
            if stop
            else f"every doubling at or above {data.threshold:g}x per 2x"
        )
        lines.append(f"{curve_name(curve, data.scaled_dimension)}: {gains}; {verdict}")
    return lines


def _heading(data: ReportData) -> tuple[str, str]:
    """The page's title and its one-line count of points by status."""
    what = {"sweep": "Sweep", "scaling": "Scaling run", "run": "Training run"}[data.kind]
    counts = Counter(p.row.get("status", "?") for p in data.points)
    listing = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    scaling = f"; {data.scaling_description}, threshold {data.threshold:g}x per 2x" if data.scaling else ""
    return f"{what} report: {data.directory}", f"{len(data.points)} point(s): {listing}{scaling}"


def _failures(data: ReportData) -> list[Point]:
    return [p for p in data.points if p.row.get("status") != "ok"]


def _markdown_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(data: ReportData, plots: list[Plot], missing: list[str]) -> str:
    """report.md: the summary, the table (one row per point) and the plots linked beside it."""
    title, subtitle = _heading(data)
    lines = [f"# {title}", "", subtitle, ""]
    summary = scaling_summary(data)
    if summary:
        lines += [f"- {line}" for line in summary] + [""]
    lines += [
        "| " + " | ".join(h for h, _ in table()) + " |",
        "|" + "---|" * len(table()),
        *("| " + " | ".join(_markdown_cell(get(p)) for _, get in table()) + " |" for p in data.points),
        "",
        ERRORS_MEAN,
        "",
    ]
    lines += [f"![{plot.title}]({plot.path.name})\n" + (f"\n{plot.note}\n" if plot.note else "") for plot in plots]
    lines += [f"Not drawn: {needs}.\n" for needs in missing]
    return "\n".join(lines)


STYLE = """
body { font-family: sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: right; white-space: nowrap; }
th { background: #f0f0f0; }
td.text { text-align: left; white-space: normal; max-width: 30em; }
tr.failed td { background: #fff0f0; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 0.8em; }
.note { color: #666; font-style: italic; }
"""


def _embedded(plot: Plot) -> str:
    data = base64.b64encode(plot.path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(plot.title)}" src="data:image/png;base64,{data}">'


def page(data: ReportData, plots: list[Plot], missing: list[str]) -> str:
    """The HTML page: nothing outside it is referenced (the plots are data URIs)."""
    e = html.escape
    title, subtitle = _heading(data)
    text_columns = {"status", "backend", "error"}
    head = "".join(f"<th>{e(h)}</th>" for h, _ in table())
    rows = []
    for p in data.points:
        cells = "".join(
            f'<td class="text">{e(get(p))}</td>' if h in text_columns else f"<td>{e(get(p))}</td>" for h, get in table()
        )
        rows.append(f'<tr class="{"ok" if p.row.get("status") == "ok" else "failed"}">{cells}</tr>')
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{e(title)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>{e(title)}</h1><p>{e(subtitle)}</p>",
    ]
    summary = scaling_summary(data)
    if summary:
        parts.append("<h2>Scaling</h2><ul>" + "".join(f"<li>{e(line)}</li>" for line in summary) + "</ul>")
    parts.append(f"<h2>Points</h2><table><tr>{head}</tr>{''.join(rows)}</table>")
    parts.append(f"<p class='note'>{e(ERRORS_MEAN)}</p>")
    for plot in plots:
        note = f"<p class='note'>{e(plot.note)}</p>" if plot.note else ""
        parts.append(f"<h2>{e(plot.title)}</h2>{_embedded(plot)}{note}")
    if missing:
        parts.append("<ul class='note'>" + "".join(f"<li>Not drawn: {e(needs)}.</li>" for needs in missing) + "</ul>")
    failures = _failures(data)
    if failures:
        parts.append("<h2>Failed and invalid points</h2>")
        for p in failures:
            point = e(p.row.get("point", ""))
            error = e(p.row.get("error") or "(no error recorded)")
            parts.append(f"<h3>{p.label}: {e(p.row.get('status', ''))}</h3><p>{point}</p><pre>{error}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def make_report(directory: Path, output: Path | None = None) -> tuple[ReportData, list[Path]]:
    """Read DIR and write OUT (default DIR/report): the PNGs, report.html and report.md."""
    data = load(directory)
    output = Path(output) if output else Path(directory) / "report"
    output.mkdir(parents=True, exist_ok=True)
    plots, missing = draw(data, output)
    (output / "report.html").write_text(page(data, plots, missing))
    (output / "report.md").write_text(markdown(data, plots, missing))
    return data, [output / "report.html", output / "report.md", *(p.path for p in plots)]


def report_command(opts) -> int:
    """`parakit report` (toolkit.cli parsed the options): 0 written, 1 DIR is not a sweep, a
    scaling run or a training run, or OUT cannot be written (one line saying which)."""
    try:
        data, written = make_report(Path(opts.dir), Path(opts.output) if opts.output else None)
    except (NotAReportDir, OSError) as error:  # OSError: OUT cannot be written (a file, no permission)
        print(f"parakit report: {error}", file=sys.stderr)
        return 1
    print(f"report of {len(data.points)} point(s) ({data.kind}): {written[0]}")
    print("  " + ", ".join(p.name for p in written[1:]))
    for line in scaling_summary(data):
        print(f"  {line}")
    return 0
