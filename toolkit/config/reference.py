"""The configuration reference, generated from the schema: every field of toolkit.config.schema.Config
with its type, bounds, schema default and the comment beside it in the source. docs/configuration.md
is this text (scripts/gen_reference_docs.py writes it); a test keeps it current.

A config group file (conf/model/llama3_8b.yaml, ...) sets many fields over these defaults:
`parakit generate ...` writes the composed values to the run's config.yaml.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import typing

from toolkit.config import schema


def _comments(cls: type) -> dict[str, str]:
    """field name -> the comment lines right above its line and the comment at its end."""
    source, _ = inspect.getsourcelines(cls)
    lines = [line.rstrip("\n") for line in source]
    found = {}
    for node in ast.parse("".join(_dedent(lines))).body[0].body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above, row = [], node.lineno - 2
        while row >= 0 and lines[row].strip().startswith("#"):
            above.insert(0, lines[row].strip().lstrip("#").strip())
            row -= 1
        ends = {lines[node.lineno - 1], lines[node.end_lineno - 1]}  # a comment on its first or last line
        trailing = " ".join(line.split("  # ", 1)[1].strip() for line in ends if "  # " in line)
        found[node.target.id] = " ".join(part for part in (*above, trailing) if part)
    return found


def _dedent(lines: list[str]) -> list[str]:
    indent = len(lines[0]) - len(lines[0].lstrip())
    return [line[indent:] + "\n" for line in lines]


def _type_name(annotation) -> str:
    if isinstance(annotation, str):
        optional = annotation.startswith("Optional[")
        return annotation.removeprefix("Optional[")[: -1 if optional else None] + " or null" * optional
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: dataclasses.Field, annotation) -> str:
    base = typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Union else annotation
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return "one of " + ", ".join(m.value for m in base)
    item = typing.get_args(base)[0] if typing.get_origin(base) is list else None
    if isinstance(item, type) and issubclass(item, enum.Enum):
        return "each one of " + ", ".join(m.value for m in item)
    bounds = field.metadata.get("bounds")
    if bounds is None:
        return ""
    signs = (("min", ">="), ("max", "<="), ("above", ">"), ("below", "<"))
    parts = [f"{sign} {_number(getattr(bounds, key))}" for key, sign in signs if getattr(bounds, key) is not None]
    if bounds.choices:
        parts.append("one of " + ", ".join(map(str, bounds.choices)))
    if bounds.pattern and not parts:
        parts.append(bounds.message)
    return ", ".join(parts) + ("; required" if bounds.required else "")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = schema.plain(field.default)
    elif field.default_factory is not dataclasses.MISSING:
        value = schema.plain(field.default_factory())
    else:
        return ""
    return "null" if value is None else f"`{value}`" if value != "" else '`""`'


def _rows(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    comments = _comments(cls)
    rows, nested = [], []
    for field in dataclasses.fields(cls):
        annotation = hints[field.name]
        if dataclasses.is_dataclass(annotation):
            nested.append((annotation, f"{prefix}{field.name}."))
            continue
        raw = cls.__annotations__[field.name]
        cells = (
            f"`{prefix}{field.name}`",
            _type_name(raw),
            _bounds(field, annotation),
            _default(field),
            comments.get(field.name, "").replace("|", "\\|"),
        )
        rows.append("| " + " | ".join(cells) + " |")
    for inner, path in nested:
        rows += _rows(inner, path)
    return rows


def configuration_reference() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from `toolkit/config/schema.py` by `python scripts/gen_reference_docs.py`; "
        "tests/test_reference_docs.py fails when it is out of date.",
        "Defaults are the schema's; the config groups (`model=`, `cluster=`, `parallel=`, ...) set many "
        "fields over them, and a run's config.yaml holds the composed values.",
    ]
    for field in dataclasses.fields(schema.Config):
        group = typing.get_type_hints(schema.Config)[field.name]
        lines += ["", f"## `{field.name}`", ""]
        if not dataclasses.is_dataclass(group):
            lines += ["| field | type | bounds | default | meaning |", "|---|---|---|---|---|"]
            lines += [row for row in _rows(schema.Config, "") if row.startswith(f"| `{field.name}`")]
            continue
        lines += ["| field | type | bounds | default | meaning |", "|---|---|---|---|---|"]
        lines += _rows(group, f"{field.name}.")
    return "\n".join(lines) + "\n"
