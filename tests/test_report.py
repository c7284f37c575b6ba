"""`parakit report DIR` on hand-made sweeps, scaling runs and run directories (no training: the
real sweep's report is exercised where the sweep itself is tested)."""

import base64
import json
import re

import pytest
from PIL import Image

from toolkit.cli import main
from toolkit.plan.doublings import Doubling, doublings, first_below
from toolkit.report.load import load
from toolkit.report.page import scaling_summary
from toolkit.report.plots import curves, per_doubling

ALL_PLOTS = ("throughput", "efficiency", "predicted_vs_measured", "loss", "stage_times")


def write_metrics(run_dir, losses, step_time=0.5, memory=1.0, val=()):
    run_dir.mkdir(parents=True, exist_ok=True)
    records = [
        {"step": s, "loss": loss, "step_time_s": step_time, "tokens_per_s": 1000 / step_time, "tflops_per_gpu": 0.01}
        | {"mfu": 0.1, "memory_gib": memory}
        for s, loss in enumerate(losses, 1)
    ]
    records += [{"step": s, "val_loss": loss} for s, loss in val]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def row(name, tmp_path, status="ok", world_size=1, tokens_per_s=None, **fields):
    """A sweep.json row; measured figures only for an ok point with tokens_per_s."""
    base = {"point": name, "status": status, "backend": "megatron", "tp": 1, "pp": 1, "vpp": 1, "cp": 1}
    base |= {"dp": world_size, "zero": 1, "micro_batch": 1, "world_size": world_size, "run_dir": str(tmp_path / name)}
    base |= {"error": ""}
    if tokens_per_s:
        base |= {"tokens_per_s": tokens_per_s, "step_time_s": 1000 / tokens_per_s, "memory_gib": 1.0}
        base |= {"predicted_step_time_s": 900 / tokens_per_s, "predicted_tokens_per_s": tokens_per_s * 1.1}
        base |= {"predicted_memory_gib": 0.8, "tflops_per_gpu": 0.01, "mfu": 0.1, "final_loss": 10.0}
    return base | fields


def write_sweep(directory, rows, scaling=None):
    directory.mkdir(parents=True, exist_ok=True)
    data = {"points": rows} | ({"scaling": scaling} if scaling else {})
    (directory / "sweep.json").write_text(json.dumps(data))
    return directory


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, request):
    """A pp=2 run directory as `parakit train` leaves it (config.yaml, metrics.jsonl, result.json)."""
    from toolkit.config.store import compose_config
    from toolkit.emit.files import write_run_files
    from toolkit.plan.layout import resolve

    run_dir = tmp_path_factory.mktemp("sweep") / "point-pipe"
    cfg = compose_config(["parallel.pp=2", "cluster.gpus_per_node=2", "data=synthetic", "model.num_layers=4"])
    write_run_files(cfg, resolve(cfg), run_dir)
    write_metrics(run_dir, [10.8, 10.5, 10.1, 9.9], val=[(4, 10.0)])
    (run_dir / "result.json").write_text(json.dumps({"steps": 4, "final_loss": 9.9}))
    return run_dir


@pytest.fixture(scope="module")
def sweep_dir(pipeline_run):
    """Three dp points (1, 2, 4 ranks), the pipeline point, a failed and an invalid point."""
    directory = pipeline_run.parent
    rows = [
        row("dp1", directory, world_size=1, tokens_per_s=100.0),
        row("dp2", directory, world_size=2, tokens_per_s=190.0),
        row("dp4", directory, world_size=4, tokens_per_s=290.0),
        row("point-pipe", directory, world_size=2, tokens_per_s=150.0, pp=2, dp=1),
        row("crash", directory, status="failed", world_size=8, tokens_per_s=1.0, error="RuntimeError: injected crash"),
        row("bad", directory, status="invalid", world_size=None, dp=None, error="[pp_divides_layers] use 2 or 4"),
    ]
    for name, losses in (("dp1", [10.8, 10.4]), ("dp2", [10.8, 10.3]), ("dp4", [10.8, 10.2])):
        write_metrics(directory / name, losses)
    return write_sweep(directory, rows)


def pngs(out):
    return sorted(p.stem for p in out.glob("*.png"))


def test_sweep_report_writes_every_plot_a_self_contained_page_and_a_table(sweep_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["report", str(sweep_dir), "--output", str(out)]) == 0
    assert "report of 6 point(s) (sweep)" in capsys.readouterr().out
    assert pngs(out) == sorted(ALL_PLOTS)
    for png in out.glob("*.png"):  # what each figure shows: test_each_plot_draws_its_rows_values
        with Image.open(png) as image:
            assert image.format == "PNG", png

    page = (out / "report.html").read_text()
    embedded = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert sorted(base64.b64decode(e) for e in embedded) == sorted(p.read_bytes() for p in out.glob("*.png"))
    assert not re.search(r"(src|href)=\"(?!data:)|<script|<link|url\(", page)  # nothing outside the page
    assert "RuntimeError: injected crash" in page and "[pp_divides_layers] use 2 or 4" in page
    assert "not recorded by these runs (result.json has no stage_times_s)" in page

    table = [line for line in (out / "report.md").read_text().splitlines() if line.startswith("| P")]
    assert [line.split(" | ")[0] for line in table] == [f"| P{i}" for i in range(1, 7)]
    assert any("invalid" in line and "use 2 or 4" in line for line in table)
    assert any("failed" in line and "injected crash" in line for line in table)


def test_default_output_is_dir_report_and_an_unwritable_output_is_one_line(sweep_dir, tmp_path, capsys):
    assert main(["report", str(sweep_dir)]) == 0
    assert (sweep_dir / "report" / "report.html").is_file() and (sweep_dir / "report" / "report.md").is_file()
    (tmp_path / "taken").write_text("a file, not a directory")
    assert main(["report", str(sweep_dir), "-o", str(tmp_path / "taken")]) == 1
    assert capsys.readouterr().err.startswith("parakit report: ")


def test_efficiency_per_doubling_of_a_constructed_curve(sweep_dir):
    data = load(sweep_dir)
    # the pp=2 point is a curve of its own; the failed point's partial figures are on none
    (dp_curve,) = [c for c in curves(data) if len(c) == 3]
    assert sorted(len(c) for c in curves(data)) == [1, 3]
    steps = doublings([p.row for p in dp_curve])
    assert [(s.from_ranks, s.to_ranks) for s in steps] == [(1, 2), (2, 4)]
    assert [per_doubling(s) for s in steps] == pytest.approx([0.95, 290 / 190 / 2])
    assert first_below(steps) == steps[1]  # 1.53x per 2x is under 1.6x
    (summary,) = [line for line in scaling_summary(data) if "dp=N" in line]
    assert "1->2: 1.90x (95% per doubling)" in summary and "first under 1.6x per 2x at 2->4" in summary
    # a 4x step counts as two doublings: 3.24x per 4x is 1.8x (90%) per doubling
    assert per_doubling(Doubling(1, 4, 3.24, 0.81, False)) == pytest.approx(0.9)


def test_scaling_run_follows_its_dimension_and_threshold(tmp_path):
    rows = [
        row(f"tp{n}", tmp_path, world_size=n, tokens_per_s=t, tp=n, dp=1)
        for n, t in ((1, 100.0), (2, 185.0), (4, 340.0))
    ]
    directory = write_sweep(tmp_path / "scale", rows, {"dimension": "tp", "mode": "strong", "threshold": 1.9})
    data = load(directory)
    assert data.kind == "scaling" and len(curves(data)) == 1  # tp varies along the one curve
    (summary,) = scaling_summary(data)
    assert summary.startswith("megatron tp=N") and "first under 1.9x per 2x at 1->2" in summary
    assert main(["report", str(directory)]) == 0
    assert pngs(directory / "report") == ["efficiency", "predicted_vs_measured", "throughput"]  # no metrics: no loss
    assert "strong scaling of tp, threshold 1.9x per 2x" in (directory / "report" / "report.html").read_text()


def test_one_run_directory_with_its_pipeline_stages(pipeline_run, tmp_path):
    from toolkit.config.store import load_run_config
    from toolkit.plan.layout import resolve
    from toolkit.plan.perf import estimate_step

    data = load(pipeline_run)
    (point,) = data.points
    assert data.kind == "run" and point.row["status"] == "ok" and point.row["pp"] == 2
    assert point.losses[-1] == (4, 9.9) and point.val_losses == [(4, 10.0)]
    # the planner's stage times are estimate_step's: the slowest stage is what the bubble charges
    cfg = load_run_config(pipeline_run)
    layout = resolve(cfg)
    estimate = estimate_step(cfg, layout)
    assert point.predicted_stage_times == pytest.approx([layout.num_microbatches * t for t in estimate.stage_times])
    assert estimate.bubble == pytest.approx((layout.pp - 1) / layout.vpp * max(estimate.stage_times))
    assert main(["report", str(pipeline_run), "-o", str(tmp_path / "out")]) == 0
    assert pngs(tmp_path / "out") == ["loss", "predicted_vs_measured", "stage_times"]
    assert "Not drawn: throughput vs ranks" in (tmp_path / "out" / "report.md").read_text()


def test_an_unfinished_run_with_a_torn_last_line(tmp_path):
    run_dir = tmp_path / "killed"
    write_metrics(run_dir, [10.8, 10.6, 10.4])
    with open(run_dir / "metrics.jsonl", "a") as log:
        log.write('{"step": 4, "lo')  # the process died mid-write
    (point,) = load(run_dir).points
    assert point.row["status"] == "failed" and "no result.json" in point.row["error"]
    assert point.losses == [(1, 10.8), (2, 10.6), (3, 10.4)] and point.row["final_loss"] == 10.4
    assert main(["report", str(run_dir)]) == 0


def test_single_point_and_only_failed_points(tmp_path):
    single = write_sweep(tmp_path / "single", [row("only", tmp_path, world_size=1, tokens_per_s=100.0)])
    assert main(["report", str(single)]) == 0
    assert pngs(single / "report") == ["predicted_vs_measured"]
    failed = [
        row("crash", tmp_path, status="failed", error="Killed"),
        row("bad", tmp_path, status="invalid", world_size=None, error="[rule] fix"),
    ]
    broken = write_sweep(tmp_path / "broken", failed)
    assert main(["report", str(broken)]) == 0
    assert pngs(broken / "report") == []
    page = (broken / "report" / "report.html").read_text()
    assert "Failed and invalid points" in page and "Killed" in page and "[rule] fix" in page


@pytest.mark.parametrize("what", ["missing", "empty", "not_json", "not_rows", "file"])
def test_a_dir_that_is_none_of_the_three_is_one_line_exit_1(tmp_path, capsys, what):
    target = tmp_path / what
    if what == "empty":
        target.mkdir()
    elif what == "not_json":
        target.mkdir()
        (target / "sweep.json").write_text("{not json")
    elif what == "not_rows":
        write_sweep(target, {"p1": "ok"})
    elif what == "file":
        target.write_text("x")
    assert main(["report", str(target)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("parakit report: ") and len(err.splitlines()) == 1 and "Traceback" not in err


# ----------------------------------------------------------------------------- the table's figures

# A sweep's rows with figures chosen by hand (sweep.json as `parakit sweep` writes it). Each
# error column is predicted / measured - 1; the values make every plausible wrong figure differ
# from the right one by more than the table rounds away: an error taken over the prediction
# instead of the measurement moves each nonzero one by 1 to 8 percentage points (+20% -> +17%,
# -25% -> -33%, +10% -> +9%), a sign flip by twice its size.
FIGURES = {
    "fast": {"world_size": 1, "dp": 1, "step_time_s": 0.5, "predicted_step_time_s": 0.6}
    | {"tokens_per_s": 2048.0, "predicted_tokens_per_s": 1706.7, "memory_gib": 1.0, "predicted_memory_gib": 1.25}
    | {"rss_gib": 2.5, "tflops_per_gpu": 0.0456, "mfu": 0.123, "final_loss": 9.87654},
    "slow": {"world_size": 2, "dp": 2, "step_time_s": 2.0, "predicted_step_time_s": 1.5}
    | {"tokens_per_s": 512.0, "predicted_tokens_per_s": 683.0, "memory_gib": 2.0, "predicted_memory_gib": 1.7}
    | {"rss_gib": 3.25, "tflops_per_gpu": 0.0123, "mfu": 0.0456, "final_loss": 10.125},
    "exact": {"world_size": 4, "dp": 2, "tp": 2, "step_time_s": 0.25, "predicted_step_time_s": 0.25}
    | {"tokens_per_s": 4096.0, "predicted_tokens_per_s": 4100.0, "memory_gib": 0.5, "predicted_memory_gib": 0.55}
    | {"rss_gib": 1.5, "tflops_per_gpu": 0.0789, "mfu": 0.2, "final_loss": 9.5},
}
NUMBER_COLUMNS = {
    "step time s": "step_time_s",
    "predicted s": "predicted_step_time_s",
    "tokens/s": "tokens_per_s",
    "predicted tokens/s": "predicted_tokens_per_s",
    "TFLOP/s per rank": "tflops_per_gpu",
    "memory GiB": "memory_gib",
    "predicted GiB": "predicted_memory_gib",
    "RSS GiB": "rss_gib",
}
LAYOUT_COLUMNS = {"tp": "tp", "pp": "pp", "vpp": "vpp", "dp": "dp", "zero": "zero"}
LAYOUT_COLUMNS |= {"micro batch": "micro_batch", "ranks": "world_size"}
ERROR_COLUMNS = {"step time error": "step_time_s", "memory error": "memory_gib"}


def markdown_table(text: str) -> list[dict]:
    """report.md's table as {header: cell} per row."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    split = [[c.replace("\\|", "|") for c in line[2:-2].split(" | ")] for line in lines]
    return [dict(zip(split[0], cells)) for cells in split[1:]]


def html_table(text: str) -> list[dict]:
    """report.html's table of points as {header: cell} per row."""
    import html

    table = re.search(r"<h2>Points</h2><table>(.*?)</table>", text, re.S).group(1)
    headers = [html.unescape(h) for h in re.findall(r"<th>(.*?)</th>", table)]
    rows = re.findall(r"<tr class=\"[a-z]+\">(.*?)</tr>", table, re.S)
    return [dict(zip(headers, (html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)))) for r in rows]


def number(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("%"))


def check_cells(cells: dict, want: dict) -> None:
    """One table row against the figures it must show (`want`: the row's own values, computed
    here, not read from the table code). Tolerances are the table's rounding: a figure of 1000 or
    more is a whole number (0.5), a smaller one 3 significant digits (0.5% relative covers half a
    unit of the third digit); the smallest defect they must catch is a column showing a
    neighbouring figure (the predicted 4100 tokens/s for the measured 4096, a mean step time of
    0.6 s for the median 0.55). Errors and MFU are whole and tenth percents (0.5 and 0.05 points):
    they catch an error over the prediction (1 point off at least, above) or of the wrong sign."""
    for header, key in LAYOUT_COLUMNS.items():
        assert cells[header] == str(want[key]), (header, cells[header], want[key])
    for header, key in NUMBER_COLUMNS.items():
        value = want.get(key)
        if value is None:
            assert cells[header] == "", (header, cells[header])
        elif abs(value) >= 1000:
            assert number(cells[header]) == pytest.approx(value, abs=0.5), (header, cells[header], value)
        else:
            assert number(cells[header]) == pytest.approx(value, rel=5e-3), (header, cells[header], value)
    for header, key in ERROR_COLUMNS.items():
        predicted, measured = want.get(f"predicted_{key}"), want.get(key)
        if predicted is None or measured is None:
            assert cells[header] == "", (header, cells[header])
            continue
        error = 100 * (predicted / measured - 1)
        assert cells[header].endswith("%") and cells[header][0] in "+-", (header, cells[header])
        assert number(cells[header]) == pytest.approx(error, abs=0.5), (header, cells[header], error)
    assert number(cells["MFU"]) == pytest.approx(100 * want["mfu"], abs=0.05), (cells["MFU"], want["mfu"])
    assert number(cells["final loss"]) == pytest.approx(want["final_loss"], rel=5e-5), cells["final loss"]
    assert (cells["status"], cells["backend"]) == (want["status"], want["backend"]), cells


def check_report_tables(out, want: list[dict]) -> None:
    """report.md's and report.html's tables: one row per point, in `want`'s order, each showing
    its figures."""
    for table in (markdown_table((out / "report.md").read_text()), html_table((out / "report.html").read_text())):
        assert [c["point"] for c in table] == [f"P{i}" for i in range(1, len(want) + 1)], table
        for cells, expected in zip(table, want):
            if expected["status"] == "ok":
                check_cells(cells, expected)
            else:  # no figures: every number and error cell empty, the error's line shown
                empty = [*NUMBER_COLUMNS, *ERROR_COLUMNS, "MFU", "final loss"]
                assert [cells[h] for h in empty] == [""] * len(empty), cells
                assert cells["status"] == expected["status"] and expected["error"] in cells["error"], cells


@pytest.fixture
def figures_sweep(tmp_path):
    """FIGURES as a sweep, with a failed and an invalid point (no figures)."""
    rows = [row(name, tmp_path) | {"tp": 1} | values for name, values in FIGURES.items()]
    rows += [
        row("crash", tmp_path, status="failed", world_size=8, error="RuntimeError: injected crash"),
        row("bad", tmp_path, status="invalid", world_size=None, dp=None, error="[rule] fix it"),
    ]
    return write_sweep(tmp_path / "figures", rows), rows


def test_the_tables_show_each_points_figures_and_the_planners_signed_error(figures_sweep, tmp_path):
    directory, rows = figures_sweep
    assert main(["report", str(directory), "-o", str(tmp_path / "out")]) == 0
    check_report_tables(tmp_path / "out", rows)  # rows are already in the table's order (by ranks)
    # the plot's labels carry the same errors: +20%, -25% and +0% on step time
    data = load(directory)
    figure = draw_one("predicted_vs_measured", data, tmp_path)
    check_predicted_vs_measured(
        figure, recorded(directory), list(FIGURES), {p.row["point"]: p.label for p in data.points}
    )


def sign_flipped(real):
    return lambda predicted, measured: None if real(predicted, measured) is None else -real(predicted, measured)


def over_the_prediction(real):
    return lambda predicted, measured: None if real(predicted, measured) is None else (predicted - measured) / predicted


@pytest.mark.mutation
@pytest.mark.parametrize("mutant", [sign_flipped, over_the_prediction])
def test_the_table_check_catches_a_wrong_error(figures_sweep, tmp_path, monkeypatch, mutant):
    """In the tables, and in the labels of the predicted-vs-measured plot (the same error)."""
    import toolkit.report.page
    import toolkit.report.plots

    for module in (toolkit.report.page, toolkit.report.plots):
        monkeypatch.setattr(module, "relative_error", mutant(module.relative_error))
    directory, rows = figures_sweep
    assert main(["report", str(directory), "-o", str(tmp_path / "out")]) == 0
    with pytest.raises(AssertionError, match="'step time error'"):
        check_report_tables(tmp_path / "out", rows)
    data = load(directory)
    figure = toolkit.report.plots.plot_predicted_vs_measured(data, tmp_path).figure
    labels = {p.row["point"]: p.label for p in data.points}
    with pytest.raises(AssertionError, match="P1 "):
        check_predicted_vs_measured(figure, recorded(directory), list(FIGURES), labels)


# A run directory's steps: two warm-up steps (slow), then four whose medians (0.55 s, 1800
# tokens/s) differ from the means (0.6 s, 1850) and from the medians over every step (0.75 s, 1400).
RUN_STEPS = [(3.0, 300.0), (2.0, 400.0), (0.4, 2600.0), (0.6, 1600.0), (0.5, 2000.0), (0.9, 1200.0)]


@pytest.fixture
def measured_run(pipeline_run, tmp_path):
    """The pp=2 run's config.yaml with RUN_STEPS in its metrics.jsonl and what each rank measured
    in its result.json."""
    run_dir = tmp_path / "measured"
    run_dir.mkdir()
    for f in pipeline_run.iterdir():
        if f.is_file():
            (run_dir / f.name).write_bytes(f.read_bytes())
    records = [
        {"step": s, "loss": 11.0 - s / 10, "step_time_s": t, "tokens_per_s": tok}
        | {"tflops_per_gpu": tok / 1e5, "mfu": tok / 1e5}
        for s, (t, tok) in enumerate(RUN_STEPS, 1)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    compute = [[0.1] * len(RUN_STEPS), [0.2] * len(RUN_STEPS)]
    ranks = [{"rank": i, "stage": i, "compute_s": compute[i]} for i in range(2)]
    result = {"steps": 6, "final_loss": 10.4, "ranks": ranks, "tensor_peak_gib": 0.75, "peak_rss_gib": 1.25}
    (run_dir / "result.json").write_text(json.dumps(result))
    return run_dir


def run_figures(run_dir) -> dict:
    """What the run directory's table row must show, from its files: medians over the steps after
    the warm-up (2) of metrics.jsonl, memory from result.json, the predictions of its config.yaml."""
    import statistics

    from toolkit.config.store import load_run_config
    from toolkit.plan.layout import resolve
    from toolkit.plan.memory import GIB, peak_memory
    from toolkit.plan.perf import estimate_step

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][2:]
    cfg = load_run_config(run_dir)
    layout = resolve(cfg)
    step = estimate_step(cfg, layout)
    want = {k: statistics.median(r[k] for r in records) for k in ("step_time_s", "tokens_per_s", "mfu")}
    want |= {"tflops_per_gpu": statistics.median(r["tflops_per_gpu"] for r in records)}
    want |= {"predicted_step_time_s": step.step_time, "predicted_tokens_per_s": step.tokens_per_s}
    want |= {"memory_gib": 0.75, "rss_gib": 1.25, "predicted_memory_gib": peak_memory(cfg, layout).tensors / GIB}
    want |= {"final_loss": records[-1]["loss"], "status": "ok", "backend": str(cfg.backend.name)}
    p = cfg.parallel
    want |= {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "dp": layout.dp, "zero": cfg.zero.stage}
    want |= {"micro_batch": cfg.train.micro_batch, "world_size": layout.world_size}
    assert (p.pp, want["step_time_s"], want["tokens_per_s"]) == (2, 0.55, 1800.0)  # the run this test wrote
    return want


def test_a_run_directorys_table_row_is_its_metrics_and_its_configs_prediction(measured_run, tmp_path):
    assert main(["report", str(measured_run), "-o", str(tmp_path / "out")]) == 0
    check_report_tables(tmp_path / "out", [run_figures(measured_run)])


@pytest.mark.mutation
def test_the_run_row_check_catches_the_warm_up_timed(measured_run, tmp_path, monkeypatch):
    """The medians taken over every step, the two slow warm-up steps included (0.75 s, not 0.55)."""
    import toolkit.report.load

    real = toolkit.report.load.measured
    monkeypatch.setattr(toolkit.report.load, "measured", lambda run_dir, warmup_steps: real(run_dir, 0))
    assert main(["report", str(measured_run), "-o", str(tmp_path / "out")]) == 0
    with pytest.raises(AssertionError, match="'step time s'"):
        check_report_tables(tmp_path / "out", [run_figures(measured_run)])


# ----------------------------------------------------------------------------- the plots' figures
#
# Each figure is read from the Figure object draw() kept (Plot.figure): its lines' points, bars,
# point labels, axis labels with their units and scales, against the values the test wrote into
# sweep.json and metrics.jsonl. Plotted values are the rows' own floats or a quotient of two, so
# points match to 1e-9 relative: the smallest defect that must fail is a point taken from another
# row or column, or a series left out (every drawn series must be expected, and every expected one
# drawn).


def xy(line) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in zip(line.get_xdata(), line.get_ydata())]


def close(got, want) -> bool:
    """Two lists of points (or of (text, point)) equal, numbers to 1e-9 relative."""

    def flat(items):
        return [v for item in items for v in (flat(item) if isinstance(item, (tuple, list)) else [item])]

    a, b = flat(got), flat(want)
    numbers = [isinstance(v, (int, float)) for v in a]
    return (
        len(a) == len(b)
        and numbers == [isinstance(v, (int, float)) for v in b]
        and [v for v, n in zip(a, numbers) if not n] == [v for v, n in zip(b, numbers) if not n]
        and [v for v, n in zip(a, numbers) if n] == pytest.approx([v for v, n in zip(b, numbers) if n], rel=1e-9)
    )


def described(lines) -> list:
    return [(xy(line), line.get_label()) for line in lines]


def match_series(drawn: list, wanted: list[tuple[list, str | None]]) -> dict:
    """Pair every drawn line with a wanted series (its points, and its legend label, or None for a
    line with none); {index in wanted: line}. Fails on a wanted series not drawn or a line not wanted."""
    left = list(drawn)
    found = {}
    for i, (points, label) in enumerate(wanted):
        for line in left:
            same = close(xy(line), points)
            if same and (line.get_label() == label if label else line.get_label().startswith("_")):
                found[i] = line
                left.remove(line)
                break
        else:
            raise AssertionError(f"not drawn: {points} {label!r}; drawn: {described(drawn)}")
    assert not left, f"drawn but not expected: {described(left)}"
    return found


def labels_at(ax) -> list[tuple[str, tuple[float, float]]]:
    """The point labels (annotations) drawn, each with the point it is by, in order."""
    return sorted((a.get_text(), (float(a.xy[0]), float(a.xy[1]))) for a in ax.texts if hasattr(a, "xy"))


def assert_labels(ax, want) -> None:
    assert close(labels_at(ax), sorted(want)), (labels_at(ax), sorted(want))


def one_axes(fig):
    assert len(fig.axes) == 1, f"{len(fig.axes)} axes"
    return fig.axes[0]


def legend_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def assert_ranks_axis(ax, ranks) -> None:
    """log2 rank axis with a tick at each power of two from the smallest to the largest point."""
    assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
    low, high = min(ranks), max(ranks)
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert ticks == [2**e for e in range(low.bit_length() - 1, high.bit_length())], ticks
    assert ax.get_xlim()[0] < low and ax.get_xlim()[1] > high


# The sweep_dir fixture's curves (sweep.json rows by point name): the dp points form one, the
# pp=2 point its own; the failed point's partial figures are on none.
SWEEP_CURVES = {"megatron dp=N zero1 mb1": ["dp1", "dp2", "dp4"], "megatron pp2 dp=N zero1 mb1": ["point-pipe"]}
SWEEP_CURVES_POINTS = [p for points in SWEEP_CURVES.values() for p in points]  # the measured points


def recorded(directory) -> dict:
    """sweep.json's rows by point name, read here (what the test wrote, not what load() made of it)."""
    return {r["point"]: r for r in json.loads((directory / "sweep.json").read_text())["points"]}


def check_throughput(fig, rows: dict, curves_by_name: dict, labels: dict) -> None:
    """Per curve: measured tokens/s (legend: the curve's layout), the planner's tokens/s, and the
    ideal line from the curve's smallest point (tokens/s x ranks / its ranks); each point's label
    by it."""
    ax = one_axes(fig)
    wanted = []
    for name, points in curves_by_name.items():
        r = [rows[p] for p in points]
        base = r[0]
        wanted.append(([(x["world_size"], x["tokens_per_s"]) for x in r], name))
        wanted.append(([(x["world_size"], x["predicted_tokens_per_s"]) for x in r], None))
        ideal = [(x["world_size"], base["tokens_per_s"] * x["world_size"] / base["world_size"]) for x in r]
        wanted.append((ideal, None))
    found = match_series(ax.lines, wanted)
    assert [found[i].get_linestyle() for i in range(3)] == ["-", "--", ":"]  # measured, predicted, ideal
    points = [p for names in curves_by_name.values() for p in names]
    assert_labels(ax, [(labels[p], (rows[p]["world_size"], rows[p]["tokens_per_s"])) for p in points])
    assert_ranks_axis(ax, [rows[p]["world_size"] for p in points])
    assert "ranks" in ax.get_xlabel() and "log2" in ax.get_xlabel(), ax.get_xlabel()
    assert "throughput" in ax.get_ylabel() and "(tokens/s" in ax.get_ylabel(), ax.get_ylabel()
    assert ax.get_ylim()[0] == 0
    assert {*curves_by_name, "planner's prediction"} <= set(legend_texts(ax))
    assert any(t.startswith("ideal linear") for t in legend_texts(ax))


def efficiency_steps(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(ranks after the step, gain per doubling, efficiency per doubling in %), from the previous point."""
    out = []
    for a, b in zip(rows, rows[1:]):
        n = (b["world_size"] // a["world_size"]).bit_length() - 1
        per = (b["tokens_per_s"] / a["tokens_per_s"]) ** (1 / n)
        out.append((b["world_size"], per, 100 * per / 2))
    return out


def check_efficiency(fig, rows: dict, curves_by_name: dict, threshold: float) -> None:
    """Per curve of two or more points: each doubling's efficiency per doubling (%) at its ranks,
    labelled with its gain per doubling; the ideal (100%) and threshold lines; a ring on the first
    doubling under the threshold of each curve."""
    ax = one_axes(fig)
    wanted = [([(0.0, 100.0), (1.0, 100.0)], None), ([(0.0, 50 * threshold), (1.0, 50 * threshold)], None)]
    texts, shown = [], []
    for name, points in curves_by_name.items():
        steps = efficiency_steps([rows[p] for p in points])
        if not steps:
            continue
        wanted.append(([(r, eff) for r, _, eff in steps], name))
        under = [(r, eff) for r, per, eff in steps if per < threshold]
        wanted += [([under[0]], None)] if under else []
        texts += [(f"{per:.2f}x per 2x", (r, eff)) for r, per, eff in steps]
        shown += [r for r, _, _ in steps]
    match_series(ax.lines, wanted)
    assert_labels(ax, texts)
    assert_ranks_axis(ax, shown)
    assert "ranks after the doubling" in ax.get_xlabel() and "log2" in ax.get_xlabel(), ax.get_xlabel()
    assert "efficiency per doubling (%)" in ax.get_ylabel(), ax.get_ylabel()
    assert f"threshold {threshold:g}x per 2x ({50 * threshold:.0f}%)" in legend_texts(ax)


def check_predicted_vs_measured(fig, rows: dict, points: list[str], labels: dict) -> None:
    """Two panels, step time (s) and peak memory (GiB): each measured point at (predicted,
    measured), labelled with its error, (predicted - measured) / measured with its sign, on a y = x
    line that spans them; log-log."""
    panels = (("step_time_s", "step time (s)"), ("memory_gib", "peak tensor memory, busiest rank (GiB)"))
    assert len(fig.axes) == 2
    for ax, (key, what) in zip(fig.axes, panels):
        pairs = {p: (rows[p][f"predicted_{key}"], rows[p][key]) for p in points}
        lines = [line for line in ax.lines if not line.get_label().startswith("y = x")]
        match_series(lines, [([pair], None) for pair in pairs.values()])
        (diagonal,) = [line for line in ax.lines if line.get_label().startswith("y = x")]
        (x0, y0), (x1, y1) = xy(diagonal)
        values = [v for pair in pairs.values() for v in pair]
        assert x0 == y0 < min(values) and x1 == y1 > max(values), xy(diagonal)
        assert_labels(ax, [(f"{labels[p]} {100 * (x / y - 1):+.0f}%", (x, y)) for p, (x, y) in pairs.items()])
        assert ax.get_xlabel() == f"planner's prediction: {what}" and ax.get_ylabel() == f"measured: {what}"
        assert ax.get_xscale() == ax.get_yscale() == "log"


def check_losses(fig, losses: dict, val_losses: dict, labels: dict, layouts: dict) -> None:
    """Each point's training losses per step (legend: its label and layout), its validation
    losses dashed; step on x, the loss in nats/token on y."""
    ax = one_axes(fig)
    wanted = [(curve, f"{labels[p]} {layouts[p]}") for p, curve in losses.items()]
    wanted += [(curve, None) for curve in val_losses.values()]
    found = match_series(ax.lines, wanted)
    assert all(found[i].get_linestyle() == "--" for i in range(len(losses), len(wanted)))
    assert ax.get_xlabel() == "step"
    assert "training loss" in ax.get_ylabel() and "nats/token" in ax.get_ylabel(), ax.get_ylabel()
    assert ("validation loss" in legend_texts(ax)) == bool(val_losses)


def check_stage_times(fig, predicted: list[float], measured: list[float] | None) -> None:
    """One bar per pipeline stage at its tick, the planner's seconds solid, the measured hatched."""
    ax = one_axes(fig)
    bars = [b for b in ax.patches if b.get_height() > 0]
    solid = [(round(b.get_x() + b.get_width() / 2), b.get_height()) for b in bars if not b.get_hatch()]
    hatched = [(round(b.get_x() + b.get_width() / 2), b.get_height()) for b in bars if b.get_hatch()]
    assert close(sorted(solid), list(enumerate(predicted))), (solid, predicted)
    assert close(sorted(hatched), list(enumerate(measured or []))), (hatched, measured)
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"stage {s}" for s in range(len(predicted))]
    assert ax.get_xlabel() == "pipeline stage" and "time per step (s" in ax.get_ylabel(), ax.get_ylabel()


def draw_one(name: str, data, out):
    """One plot's figure, drawn on its own."""
    from toolkit.report import plots

    return getattr(plots, {"loss": "plot_losses"}.get(name, f"plot_{name}"))(data, out).figure


def drawn(directory, out) -> tuple[dict, dict]:
    """draw()'s plots of DIR by name, and each point's label by its name (P1, ... by the table)."""
    from toolkit.report.plots import draw

    data = load(directory)
    out.mkdir(exist_ok=True)
    plots, _ = draw(data, out)
    return {p.name: p for p in plots}, {p.row.get("point"): p for p in data.points}


def stage_expectation(run_dir) -> list[float]:
    """The planner's seconds per step on each stage, from the run's config.yaml."""
    from toolkit.config.store import load_run_config
    from toolkit.plan.layout import resolve
    from toolkit.plan.perf import estimate_step

    cfg = load_run_config(run_dir)
    layout = resolve(cfg)
    return [layout.num_microbatches * t for t in estimate_step(cfg, layout).stage_times]


def check_sweep_plots(plots: dict, points: dict, directory, pipeline_run) -> None:
    rows = recorded(directory)
    labels = {name: p.label for name, p in points.items()}
    assert sorted(plots) == sorted(ALL_PLOTS)
    check_throughput(plots["throughput"].figure, rows, SWEEP_CURVES, labels)
    check_efficiency(plots["efficiency"].figure, rows, SWEEP_CURVES, 1.6)
    check_predicted_vs_measured(plots["predicted_vs_measured"].figure, rows, SWEEP_CURVES_POINTS, labels)
    losses, val_losses = {}, {}
    for name in SWEEP_CURVES_POINTS:
        records = [json.loads(line) for line in (directory / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [(r["step"], r["loss"]) for r in records if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        val_losses |= {name: val} if val else {}
    layouts = {name: p.layout for name, p in points.items()}
    check_losses(plots["loss"].figure, losses, val_losses, labels, layouts)
    check_stage_times(plots["stage_times"].figure, stage_expectation(pipeline_run), None)


def test_each_plot_draws_its_rows_values(sweep_dir, pipeline_run, tmp_path):
    plots, points = drawn(sweep_dir, tmp_path / "out")
    check_sweep_plots(plots, points, sweep_dir, pipeline_run)


@pytest.fixture
def recorded_stages(pipeline_run, tmp_path):
    """The pp=2 run with the per-stage times a run records in result.json."""
    run_dir = tmp_path / "stages"
    run_dir.mkdir()
    for f in pipeline_run.iterdir():
        if f.is_file():
            (run_dir / f.name).write_bytes(f.read_bytes())
    result = json.loads((pipeline_run / "result.json").read_text())
    (run_dir / "result.json").write_text(json.dumps(result | {"stage_times_s": [0.3, 0.4]}))
    return run_dir


def test_measured_stage_times_are_hatched_beside_the_planners(recorded_stages, tmp_path):
    plots, points = drawn(recorded_stages, tmp_path / "out")
    (point,) = points.values()
    assert point.measured_stage_times == [0.3, 0.4]  # result.json's stage_times_s
    check_stage_times(plots["stage_times"].figure, stage_expectation(recorded_stages), [0.3, 0.4])
    assert "measured (hatched)" in legend_texts(plots["stage_times"].figure.axes[0])
    assert plots["stage_times"].note == ""  # nothing left unmeasured to say


# A scaling run whose 2-rank point failed: 1 -> 4 ranks is one step of two doublings (2.4x is
# 1.55x per 2x: under 1.6x, though 2.4x is above it), then 4 -> 8 gains 1.96x.
GAP = {"n1": (1, 100.0), "n2": (2, 180.0), "n4": (4, 240.0), "n8": (8, 470.0)}


def test_a_4x_step_is_drawn_as_two_doublings(tmp_path):
    rows = [row(name, tmp_path, world_size=n, tokens_per_s=t) for name, (n, t) in GAP.items()]
    rows[1]["status"] = "failed"
    directory = write_sweep(tmp_path / "gap", rows, {"dimension": "dp", "mode": "weak", "threshold": 1.6})
    plots, points = drawn(directory, tmp_path / "out")
    curve = {"megatron dp=N zero1 mb1": ["n1", "n4", "n8"]}
    labels = {name: p.label for name, p in points.items()}
    check_throughput(plots["throughput"].figure, recorded(directory), curve, labels)
    check_efficiency(plots["efficiency"].figure, recorded(directory), curve, 1.6)
    # the worked numbers: sqrt(2.4) = 1.549 per doubling (77.5%), ringed; then 470/240 = 1.958 (97.9%)
    (ax,) = plots["efficiency"].figure.axes
    assert close(labels_at(ax), [("1.55x per 2x", (4, 50 * 2.4**0.5)), ("1.96x per 2x", (8, 50 * 470 / 240))])
    (ring,) = [line for line in ax.lines if line.get_markersize() == 15]
    assert close(xy(ring), [(4, 50 * 2.4**0.5)])


def blank(monkeypatch):
    """Every plot saved and kept as an empty figure of the same size (its PNG as large as a drawn one)."""
    from matplotlib.figure import Figure

    import toolkit.report.plots as plots

    real = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, *a: real(Figure(figsize=fig.get_size_inches()), *a))


def second_series_dropped(monkeypatch):
    """The second series a report draws (line or bars) is left out: one curve's ideal line, the
    efficiency plot's ring, the first point against its prediction, a loss curve, measured bars."""
    from matplotlib.axes import Axes

    calls = {"n": 0}
    for method in ("plot", "bar"):
        real = getattr(Axes, method)

        def drawing(self, *args, _real=real, **kwargs):
            calls["n"] += 1
            return [] if calls["n"] == 2 else _real(self, *args, **kwargs)

        monkeypatch.setattr(Axes, method, drawing)


@pytest.mark.mutation
@pytest.mark.parametrize("plot", ALL_PLOTS)
@pytest.mark.parametrize("mutant", [blank, second_series_dropped])
def test_the_plot_checks_catch_an_empty_figure_or_a_dropped_series(
    sweep_dir, recorded_stages, tmp_path, monkeypatch, plot, mutant
):
    """Per plot, drawn on its own (the second series counts from its first; the stage plot's is the
    measured bars of the run that recorded them)."""
    from toolkit.report import plots as plotting

    stages = plot == "stage_times"
    data = load(recorded_stages if stages else sweep_dir)
    labels = {p.row.get("point"): p.label for p in data.points}
    rows = recorded(sweep_dir)
    out = tmp_path / "out"
    out.mkdir()
    mutant(monkeypatch)
    drawn_plot = getattr(plotting, {"loss": "plot_losses"}.get(plot, f"plot_{plot}"))(data, out)
    if mutant is blank:  # what the pixel-size check let through: a full-size PNG of nothing
        with Image.open(drawn_plot.path) as image:
            assert image.width >= 800 and image.height >= 400
    check = {
        "throughput": lambda f: check_throughput(f, rows, SWEEP_CURVES, labels),
        "efficiency": lambda f: check_efficiency(f, rows, SWEEP_CURVES, 1.6),
        "predicted_vs_measured": lambda f: check_predicted_vs_measured(f, rows, list(SWEEP_CURVES_POINTS), labels),
        "loss": lambda f: check_losses(
            f,
            {p.row["point"]: p.losses for p in data.points if p.losses},
            {p.row["point"]: p.val_losses for p in data.points if p.val_losses},
            labels,
            {p.row.get("point"): p.layout for p in data.points},
        ),
        "stage_times": lambda f: check_stage_times(f, stage_expectation(recorded_stages), [0.3, 0.4]),
    }[plot]
    with pytest.raises(AssertionError):
        check(drawn_plot.figure)


def test_a_sweep_point_records_and_the_page_shows_the_predicted_all_to_all_share(compose):
    """An expert-parallel point carries the share of its predicted step the MoE layers' all-to-all
    takes (sweep.csv, the report table); a dense point's is 0 and its cell empty."""
    from toolkit.plan.layout import resolve
    from toolkit.report.load import Point
    from toolkit.report.page import table
    from toolkit.report.sweep import _predicted

    moe = compose("model=tiny_moe", "cluster=8xh100", "parallel.ep=8")
    dense = compose("cluster=8xh100")
    share = _predicted(moe, resolve(moe))["predicted_all_to_all_share"]
    assert 0 < share < 1 and _predicted(dense, resolve(dense))["predicted_all_to_all_share"] == 0
    cell = dict(table())["predicted all-to-all"]
    assert cell(Point({"predicted_all_to_all_share": share}, "P1")) == f"{share:.0%}"
    assert cell(Point({"predicted_all_to_all_share": 0.0}, "P2")) == ""
