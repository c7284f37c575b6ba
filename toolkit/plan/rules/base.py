"""What every rule returns and the helpers their messages share."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from toolkit.plan.backends import supporting
from toolkit.plan.layout import world_size
from toolkit.plan.parallel_dims import ParallelDims

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class Violation:
    rule: str  # short id, e.g. "pp_layers"
    severity: str  # error | warning
    fields: dict  # field path -> value, the values that break the rule
    message: str  # what is wrong
    fix: str  # a concrete change that satisfies the rule

    def __str__(self) -> str:
        values = ", ".join(f"{k}={v.value if isinstance(v, Enum) else v!r}" for k, v in self.fields.items())
        return f"{self.severity} [{self.rule}] {values}: {self.message}. Fix: {self.fix}"


def err(rule, fields, message, fix):
    return Violation(rule, ERROR, fields, message, fix)


def warn(rule, fields, message, fix):
    return Violation(rule, WARNING, fields, message, fix)


def divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def listing(values) -> str:
    values = list(values)
    if len(values) > 12:
        values = values[:6] + ["..."] + values[-3:]
    return ", ".join(str(v) for v in values)


def others(feature) -> str:
    """`backend=NAME` for the backends that have `feature` (a fix's alternative)."""
    return " or ".join(f"backend={name}" for name in supporting(feature))


def configured_dims(cfg) -> ParallelDims:
    """The configured degrees, dp derived from the world size where unset (the rules read them
    before a layout is resolved)."""
    p = cfg.parallel
    model_parallel = ParallelDims.of(p, dp=1).model_parallel_size
    return ParallelDims.of(p, dp=p.dp or max(world_size(cfg) // model_parallel, 1))
