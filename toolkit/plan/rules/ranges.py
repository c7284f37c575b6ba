"""Value ranges, read from the schema's field metadata (toolkit.config.schema.Bounds): one place
says what a field may hold. Closed sets of values (dtype, recompute, backend, ...) are enums in the
schema: composition refuses any other value and names the allowed ones."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Iterator

from toolkit.config.schema import Bounds, Config
from toolkit.plan.memo import during_search
from toolkit.plan.rules.base import Violation, err


def _check(section, prefix: str, non_finite: list, outside: list) -> None:
    """Add a section's fields (nested sections included, in the order of the fields) that are
    non-finite numbers to `non_finite` as (path, value, field), and those outside their bounds to
    `outside` as (path, value, bounds)."""
    for name, f, bounds in _class_fields(type(section)):
        value = getattr(section, name)
        if dataclasses.is_dataclass(value):
            _check(value, f"{prefix}{name}.", non_finite, outside)
        elif isinstance(value, dict):  # cluster.stack: a section per key
            for key, item in value.items():
                _check(item, f"{prefix}{name}.{key}.", non_finite, outside)
        else:
            _check_value(f"{prefix}{name}", value, f, bounds, non_finite, outside)


def _check_value(path: str, value, f: dataclasses.Field, bounds, non_finite: list, outside: list) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        non_finite.append((path, value, f))
    if bounds is not None and (value is not None or bounds.required) and _outside(bounds, value):
        outside.append((path, value, bounds))


@functools.cache
def _class_fields(cls: type) -> tuple[tuple[str, dataclasses.Field, Bounds | None], ...]:
    """A configuration class's fields: name, field and bounds (None where it has none)."""
    return tuple((f.name, f, f.metadata.get("bounds")) for f in dataclasses.fields(cls))


@during_search()
def _section(section, prefix: str) -> tuple[tuple, tuple]:
    """_check of one section, as (non-finite, outside) tuples (a layout search's candidates share
    most of their sections: each is read once)."""
    non_finite: list = []
    outside: list = []
    _check(section, prefix, non_finite, outside)
    return tuple(non_finite), tuple(outside)


def _findings(cfg: Config) -> tuple[list, list]:
    """The configuration's non-finite fields and those outside their bounds, in the order of its fields."""
    non_finite: list = []
    outside: list = []
    for name, f, bounds in _class_fields(type(cfg)):
        value = getattr(cfg, name)
        if dataclasses.is_dataclass(value):
            found = _section(value, f"{name}.")
            non_finite += found[0]
            outside += found[1]
        else:  # a value of the configuration itself (its description)
            _check_value(name, value, f, bounds, non_finite, outside)
    return non_finite, outside


def _non_finite(non_finite: list) -> Iterator[Violation]:
    """nan and inf compare false with every bound, so the range rules would let them through."""
    for path, value, f in non_finite:
        example = ", or null to turn it off" if f.default is None else f", e.g. {f.default:g}"
        yield err("finite", {path: value}, "must be a finite number", f"set {path} to a finite number{example}")


def _outside(b: Bounds, value) -> bool:
    if value is None:
        return b.required
    if isinstance(value, list):  # each item
        return any(_outside(b, item) for item in value)
    if b.pattern is not None:
        return not re.fullmatch(b.pattern, value)
    if b.choices is not None:
        return value not in b.choices
    if b.above is not None and value <= b.above:
        return True
    if not math.isfinite(value):
        return False
    return (
        (b.min is not None and value < b.min)
        or (b.max is not None and value > b.max)
        or (b.below is not None and value >= b.below)
    )


def ranges(cfg: Config) -> Iterator[Violation]:
    non_finite, outside = _findings(cfg)
    yield from _non_finite(non_finite)
    found: dict[tuple[str, str, str], dict] = {}  # fields that break the same bound are reported together
    for path, value, b in outside:
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
    if cfg.train.steps is not None and cfg.train.tokens is not None:  # steps would win without a word
        yield err(
            "train_length",
            {"train.steps": cfg.train.steps, "train.tokens": cfg.train.tokens},
            "the run's length is given twice, in steps and in tokens",
            "set train.steps=null to size the run by train.tokens, or train.tokens=null to keep train.steps",
        )
