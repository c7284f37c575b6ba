"""`parakit report DIR` on hand-made sweeps, scaling runs and run directories (no training: the
real sweep's report is exercised where the sweep itself is tested)."""

import base64
import json
import re

import pytest
from PIL import Image

from toolkit.cli import main
from toolkit.report.load import load
from toolkit.report.page import scaling_summary
from toolkit.report.plots import curves, per_doubling
from toolkit.report.scaling import Doubling, doublings, first_below

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
    for png in out.glob("*.png"):
        with Image.open(png) as image:
            assert image.format == "PNG" and image.width >= 800 and image.height >= 400, png

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


def test_measured_stage_times_are_drawn_when_a_run_records_them(pipeline_run, tmp_path):
    from toolkit.report.plots import plot_stage_times

    result = json.loads((pipeline_run / "result.json").read_text())
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    for f in pipeline_run.iterdir():
        if f.is_file():
            (recorded / f.name).write_bytes(f.read_bytes())
    (recorded / "result.json").write_text(json.dumps(result | {"stage_times_s": [0.3, 0.4]}))
    data = load(recorded)
    assert data.points[0].measured_stage_times == [0.3, 0.4]
    plot = plot_stage_times(data, tmp_path)
    assert plot.note == "" and plot.path.is_file()


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
