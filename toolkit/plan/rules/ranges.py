"""Value ranges, read from the schema's field metadata (toolkit.config.schema.Bounds): one place
says what a field may hold. Closed sets of values (dtype, recompute, backend, ...) are enums in the
schema: composition refuses any other value and names the allowed ones."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterator

from toolkit.config.schema import Bounds, Config
from toolkit.plan.rules.base import Violation, err


def _fields(section, prefix: str = "") -> Iterator[tuple[str, object, dataclasses.Field]]:
    """(path, value, field) of every field of a configuration, nested sections included."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from _fields(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value, f


def _non_finite(cfg: Config) -> Iterator[Violation]:
    """nan and inf compare false with every bound, so the range rules would let them through."""
    for path, value, f in _fields(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            example = ", or null to turn it off" if f.default is None else f", e.g. {f.default:g}"
            yield err("finite", {path: value}, "must be a finite number", f"set {path} to a finite number{example}")


def _outside(b: Bounds, value) -> bool:
    if b.pattern is not None:
        return any(not re.fullmatch(b.pattern, item) for item in (value if isinstance(value, list) else [value]))
    if b.choices is not None:
        return value not in b.choices
    if b.above is not None and value <= b.above:
        return True
    if not math.isfinite(value):
        return False
    return (b.min is not None and value < b.min) or (b.below is not None and value >= b.below)


def ranges(cfg: Config) -> Iterator[Violation]:
    yield from _non_finite(cfg)
    found: dict[tuple[str, str, str], dict] = {}  # fields that break the same bound are reported together
    for path, value, f in _fields(cfg):
        b = f.metadata.get("bounds")
        if b is not None and value is not None and _outside(b, value):
            found.setdefault((b.rule, b.message, b.fix.format(path=path)), {})[path] = value
    for (rule, message, fix), fields in found.items():
        yield err(rule, fields, message, fix)
    if cfg.train.steps is None and cfg.train.tokens is None:
        yield err(
            "train_length",
            {"train.steps": None, "train.tokens": None},
            "the run has no length",
            "set train.steps=N or train.tokens=N",
        )
