"""The validator's rules as data: value bounds kept in the schema's field metadata, and the
backend capabilities as a table read from the backend descriptions. Each rule's own reject and
accept cases are in test_validate.py; here, that the tables are complete and each entry acts."""

from __future__ import annotations

import dataclasses
import re
import typing
from enum import Enum

import pytest
import test_comm_validate
import test_experts_validate
import test_validate

from toolkit.config import schema
from toolkit.config.schema import Bounds, Config, StackCosts
from toolkit.plan import backends
from toolkit.plan.rules import capabilities
from toolkit.plan.validate import validate


def bounded_fields(section=Config, prefix=""):
    """(path, Bounds) of every field of the configuration that declares bounds."""
    for f in dataclasses.fields(section):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from bounded_fields(type(default), f"{prefix}{f.name}.")
        elif "bounds" in f.metadata and not isinstance(default, list):  # a list's items: the test below
            yield f"{prefix}{f.name}", f.metadata["bounds"]


def outside(b: Bounds) -> list:
    """A value just outside each side of the bounds (numbers: what an override can say)."""
    if b.choices is not None:
        return [max(b.choices) + 1, min(b.choices) - 1]
    sides = [b.min - 1 if b.min is not None else None, b.max + 1 if b.max is not None else None, b.below, b.above]
    return [value for value in sides if value is not None]


def leaf_fields(section=Config, prefix=""):
    """(path, field, type) of every value of the configuration, nested sections and cluster.stack's
    per-backend sections walked into (a stack entry under the name "megatron")."""
    hints = typing.get_type_hints(section, vars(schema))
    for f in dataclasses.fields(section):
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = args[0] if typing.get_origin(kind) is typing.Union else kind
        if dataclasses.is_dataclass(kind):
            yield from leaf_fields(kind, f"{prefix}{f.name}.")
        elif typing.get_origin(kind) is dict:
            yield from leaf_fields(typing.get_args(kind)[1], f"{prefix}{f.name}.megatron.")
        else:
            yield f"{prefix}{f.name}", f, kind


def unchecked(kind) -> bool:
    """Values composition itself confines: enums, booleans, lists of enums."""
    item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else kind
    return item is bool or (isinstance(item, type) and issubclass(item, Enum))


def bad_values(b: Bounds, kind) -> list:
    """Values each side of the bounds, as the configuration would hold them: two lines of text for a
    pattern (every pattern refuses control characters), null where the field must be given."""
    values = ["two\nlines"] if b.pattern is not None else outside(b)
    values += [None] * b.required
    return [[v] if typing.get_origin(kind) is list and v is not None else v for v in values]


def with_value(section, path: str, value):
    """`section` with the field at `path` set to `value` (a dict's missing entry made with defaults)."""
    head, _, rest = path.partition(".")
    if not rest:
        return dataclasses.replace(section, **{head: value})
    inner = getattr(section, head)
    if isinstance(inner, dict):
        key, _, rest = rest.partition(".")
        return dataclasses.replace(
            section, **{head: {**inner, key: with_value(inner.get(key, StackCosts()), rest, value)}}
        )
    return dataclasses.replace(section, **{head: with_value(inner, rest, value)})


def test_every_number_text_and_list_field_declares_its_bounds():
    """A field added without bounds fails here: what is not an enum or a switch has a range or pattern."""
    missing = [path for path, f, kind in leaf_fields() if not unchecked(kind) and "bounds" not in f.metadata]
    assert not missing, f"fields without bounds in the schema: {missing}"


LEAVES = [(p, f.metadata["bounds"], kind) for p, f, kind in leaf_fields() if "bounds" in f.metadata]
BAD = [(path, b, value) for path, b, kind in LEAVES for value in bad_values(b, kind)]


def test_every_value_outside_any_fields_bounds_is_refused_by_name_never_raised(compose):
    """Every field, each side of its bounds, set in the composed configuration (what a team's file or
    an override would give): the validator reports that field with its message and fix, and raises
    nothing; so does the planner's search."""
    from toolkit.plan.search import search

    base = compose("checks.memory=off")
    assert len(BAD) >= 150
    for path, bounds, value in BAD:
        report = validate(with_value(base, path, value))
        hits = [v for v in report.errors if v.rule == bounds.rule and path in v.fields]
        assert hits, f"{path}={value!r}: {report}"
        assert hits[0].message == bounds.message and hits[0].fix == bounds.fix.format(path=path)
    for path, _, value in BAD:  # a cluster file's mistakes do not depend on the layout: nothing is ranked
        if path.startswith("cluster."):
            assert search(with_value(base, path, value)).ranked == [], path


OUTSIDE = [(path, bounds, value) for path, bounds in bounded_fields() for value in outside(bounds)]


def test_the_schema_declares_the_bounds_of_the_fields_the_range_rules_check():
    paths = dict(bounded_fields())
    assert len(paths) >= 50
    assert {"parallel.tp", "train.global_batch", "optim.lr", "model.hidden_dropout", "zero.stage"} <= set(paths)


@pytest.mark.parametrize("path,bounds,value", OUTSIDE, ids=[f"{p}={v}" for p, _, v in OUTSIDE])
def test_a_value_outside_a_fields_bounds_is_refused_by_name(compose, path, bounds, value):
    report = validate(compose("checks.memory=off", f"{path}={value}"))
    hits = [v for v in report.errors if v.rule == bounds.rule and path in v.fields]
    assert hits, f"{path}={value}: {report}"
    assert hits[0].message == bounds.message and hits[0].fix == bounds.fix.format(path=path)


def test_every_capability_has_a_reject_case():
    cased = {
        rule for rule, *_ in test_validate.ERROR_CASES + test_experts_validate.CASES + test_comm_validate.CASES
    } | {rule for rule, *_ in CASES}
    cased.add("hf_path_backend")  # no backend lacks it: the last test here gives one a description without
    cased.add("moe_backend")  # neither: test_experts_validate gives one a description without experts
    for capability in capabilities.CAPABILITIES:
        pattern = re.compile(capability.rule.replace("{b}", "(megatron|deepspeed)").replace("{dtype}", "fp8") + "$")
        assert any(pattern.match(rule) for rule in cased), f"no reject case for {capability.rule}"


# Capabilities test_validate.py has no case for: (rule, bad, good, field).
CASES = [
    (
        "uneven_pipeline_backend",
        ["backend=deepspeed", "parallel.pp=2", "parallel.first_stage_layers=2"],
        ["backend=megatron", "parallel.pp=2", "parallel.first_stage_layers=2"],
        "parallel.first_stage_layers",
    ),
]


@pytest.mark.parametrize("rule,bad,good,field", CASES, ids=[c[0] for c in CASES])
def test_capability_rejects_with_field_and_fix(compose, rule, bad, good, field):
    hits = [v for v in validate(compose("checks.memory=off", *bad)).errors if v.rule == rule]
    assert hits and field in hits[0].fields and "Fix: " in str(hits[0])
    assert validate(compose("checks.memory=off", *good)).ok


def test_a_backend_without_hugging_face_weights_refuses_model_hf_path(compose, tmp_path, monkeypatch):
    """No backend lacks Hugging Face weights today: a description without them shows the entry
    acts, and its fix names the backends that have them."""
    (tmp_path / "config.json").write_text("{}")
    cfg = compose("checks.memory=off", f"model.hf_path={tmp_path}")
    without = dataclasses.replace(backends.backend_of(cfg), hf_weights=())
    monkeypatch.setattr(capabilities, "backend_of", lambda cfg: without)
    hits = [v for v in capabilities.backend(cfg) if v.rule == "hf_path_backend"]
    assert len(hits) == 1 and hits[0].fields == {"model.hf_path": str(tmp_path), "backend.name": "megatron"}
    assert "backend=megatron or backend=deepspeed" in hits[0].fix
    monkeypatch.undo()
    assert not [v for v in capabilities.backend(cfg) if v.rule == "hf_path_backend"]
