"""docs/configuration.md and docs/commands.md are what scripts/gen_reference_docs.py writes from the
schema and the argument parsers today: a field or an option added, removed or re-described without
regenerating them fails here."""

import dataclasses
import typing
from pathlib import Path

from toolkit.cli import COMMANDS, command_reference
from toolkit.config import schema
from toolkit.config.reference import configuration_reference

DOCS = Path(__file__).resolve().parent.parent / "docs"
FIX = "out of date: run `python scripts/gen_reference_docs.py` and commit docs/"


def leaf_paths(cls: type, prefix: str = "") -> list[str]:
    paths = []
    for field in dataclasses.fields(cls):
        annotation = typing.get_type_hints(cls)[field.name]
        if dataclasses.is_dataclass(annotation):
            paths += leaf_paths(annotation, f"{prefix}{field.name}.")
        else:
            paths.append(prefix + field.name)
    return paths


def test_the_configuration_reference_is_current_and_lists_every_field():
    text = (DOCS / "configuration.md").read_text()
    assert text == configuration_reference(), f"docs/configuration.md {FIX}"
    missing = [path for path in leaf_paths(schema.Config) if f"| `{path}` |" not in text]
    assert not missing, missing
    assert "| `train.kernels` | KernelChoice | one of auto, fused, reference | `auto` |" in text


def test_the_command_reference_is_current_and_lists_every_command_and_option():
    text = (DOCS / "commands.md").read_text()
    assert text == command_reference(), f"docs/commands.md {FIX}"
    for command in COMMANDS.values():
        assert f"## `parakit {command.name}`" in text
        for option in command.options:
            flag = option.flags[0]
            shown = flag if flag.startswith("-") else option.kwargs.get("metavar", flag)  # a positional's metavar
            assert shown in text, (command.name, option.flags)
