"""The planner's top K measured: `plan --measure K` and `sweep --from-plan K`.

NeMo's auto-configurator ranks layouts by running them; parakit keeps the analytic ranking beside
the measured one. Each candidate is one sweep point (validated, trained through torchrun,
recorded in SWEEP_DIR/sweep.json), so a second run skips what was measured and `parakit report`
and `parakit calibrate` read the same directory.
"""

from __future__ import annotations

import time
from pathlib import Path

from toolkit.config.schema import Config
from toolkit.plan.search import Candidate, search
from toolkit.report.sweep import SweepOptions, point_dir, progress_line, run_point


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def candidate_overrides(candidate: Candidate, user_overrides: list[str]) -> list[str]:
    """The user's overrides with the candidate's layout in place of any layout they set."""
    mine = candidate.overrides()
    keys = {_key(o) for o in mine}
    return [o for o in user_overrides if _key(o) not in keys] + mine


def measure_top(cfg: Config, k: int, user_overrides: list[str], sweep_dir: Path, opts: SweepOptions):
    """[(planned rank, candidate, row)] for the planner's top k, each measured as a sweep point."""
    ranked = search(cfg).ranked[:k]
    opts.total_points, opts.started = len(ranked), time.time()
    measured = []
    for rank, candidate in enumerate(ranked, start=1):
        overrides = candidate_overrides(candidate, user_overrides)
        row = run_point(candidate.cfg, overrides, sweep_dir / point_dir(overrides), sweep_dir, opts)
        print(progress_line(row, rank, opts), flush=True)
        measured.append((rank, candidate, row))
    return measured


def layout_label(candidate: Candidate) -> str:
    """What tells two candidates apart: the split, micro-batch and ZeRO stage, sequence parallel
    and recompute where they are on (two candidates may differ only there)."""
    lay, c = candidate.layout, candidate.cfg
    label = f"{lay.dims.label()} mb={lay.micro_batch} z={c.zero.stage}"
    if c.parallel.sequence_parallel:
        label += " sp"
    if str(c.recompute.granularity) != "none":
        label += f" rc={c.recompute.granularity}"
    return label


def measured_table(measured) -> str:
    """Ranked by measured tokens/s (failed points last), the planner's rank and figures beside."""
    order = sorted(measured, key=lambda m: -(m[2].get("tokens_per_s") or float("-inf")))
    lines = [
        f"{'#':>2} {'plan #':>6}  {'layout':<46}{'predicted tok/s':>16}{'measured tok/s':>15}{'error':>8}"
        f"{'pred GiB':>9}{'meas GiB':>9}  status"
    ]
    for i, (rank, candidate, row) in enumerate(order, start=1):
        shape = layout_label(candidate)
        predicted, got = candidate.step.tokens_per_s, row.get("tokens_per_s")
        error = f"{predicted / got - 1:+.0%}" if got else "-"
        memory = f"{row['memory_gib']:.2f}" if row.get("memory_gib") else "-"
        lines.append(
            f"{i:>2} {rank:>6}  {shape:<46}{predicted:>16,.0f}{(f'{got:,.0f}' if got else '-'):>15}{error:>8}"
            f"{candidate.memory.total / 2**30:>9.2f}{memory:>9}  {row['status']}"
        )
    return "\n".join(lines)
