"""What a multi-node launch.sh asks Slurm for, checked against itself."""

from __future__ import annotations

import re
from typing import Iterator

from toolkit.config.schema import Config
from toolkit.plan.rules.base import Violation, err


def time_limit_seconds(text: str | None) -> int | None:
    """sbatch --time in seconds (Slurm's sbatch(1): "minutes", "minutes:seconds",
    "hours:minutes:seconds", "days-hours", "days-hours:minutes", "days-hours:minutes:seconds");
    None for none given, INFINITE or UNLIMITED, or a form the schema's bounds refuse."""
    if not text or text in ("INFINITE", "UNLIMITED"):
        return None
    days, _, clock = text.rpartition("-") if "-" in text else ("", "", text)
    parts = [int(p) for p in clock.split(":")] if re.fullmatch(r"\d+(:\d+)*", clock) else None
    if parts is None or len(parts) > 3:
        return None
    if days:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    hours, minutes, seconds = parts if len(parts) == 3 else (0, *parts, 0)[:3]  # minutes[:seconds]
    return (hours * 60 + minutes) * 60 + seconds


def signal_lead(cfg: Config) -> Iterator[Violation]:
    """The preemption signal comes signal_before_s before the time limit: a lead as long as the
    limit signals the job at its start (Slurm sends it at once), and the run stops after its first
    step to requeue, again and again."""
    s = cfg.cluster.slurm
    limit = time_limit_seconds(s.time)
    if cfg.cluster.nodes < 2 or not s.signal_before_s or limit is None or s.signal_before_s < limit:
        return
    yield err(
        "slurm_signal",
        {"cluster.slurm.signal_before_s": s.signal_before_s, "cluster.slurm.time": s.time},
        f"the preemption signal would come {s.signal_before_s} s before a time limit of {limit} s, at the job's start",
        f"set cluster.slurm.signal_before_s below {limit} (a few minutes, the time one step and a save take), or "
        "lengthen cluster.slurm.time",
    )
