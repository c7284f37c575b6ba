"""Regenerates megatron_lm_args.json: every option of Megatron-LM's pretrain_gpt.py parser (its
long flags, destination, action, default, nargs, type and choices), read from the parser itself.

    python tests/data/megatron_lm_args.py /path/to/Megatron-LM   # a checkout at the tag to record

The tests rebuild that parser from the file (tests/megatron_lm.py), so they read parakit's
megatron_args.txt exactly as Megatron-LM's argparse would, without a Megatron-LM checkout.
Megatron-LM wants Python >= 3.12 (typing.override); on 3.11 a no-op stands in for it, which
changes no option.
"""

from __future__ import annotations

import argparse
import enum
import json
import subprocess
import sys
import typing
import warnings
from pathlib import Path

OUT = Path(__file__).with_suffix(".json")
ACTIONS = {
    argparse._StoreAction: "store",
    argparse._StoreTrueAction: "store_true",
    argparse._StoreFalseAction: "store_false",
    argparse._StoreConstAction: "store_const",
    argparse._AppendAction: "append",
}


def plain(value):
    """A default or choice as JSON: enums by name, other objects (torch dtypes) by their repr."""
    if isinstance(value, enum.Enum):
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return {"repr": repr(value)}


def type_name(kind) -> str | None:
    if kind is None:
        return None
    if kind in (int, float, str):
        return kind.__name__
    return getattr(kind, "__name__", repr(kind))


def options(parser: argparse.ArgumentParser) -> list[dict]:
    rows = []
    for action in parser._actions:
        flags = [f for f in action.option_strings if f.startswith("--")]
        if not flags or isinstance(action, argparse._HelpAction):
            continue
        rows.append(
            {
                "flags": flags,
                "dest": action.dest,
                "action": ACTIONS.get(type(action), type(action).__name__),
                "default": plain(action.default),
                "nargs": action.nargs,
                "type": type_name(action.type),
                "choices": plain(list(action.choices)) if action.choices is not None else None,
                "const": plain(action.const),
            }
        )
    return sorted(rows, key=lambda row: row["flags"][0])


def main(checkout: str) -> None:
    if not hasattr(typing, "override"):
        typing.override = lambda f: f
    sys.path.insert(0, checkout)
    warnings.simplefilter("ignore")
    from toolkit.compat import import_shims

    import_shims()  # megatron.core imports triton, which the CPU machine does not have
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    commit = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    rows = options(parser)
    head = {"source": "NVIDIA/Megatron-LM megatron/training/arguments.py", "commit": commit.strip()}
    lines = ",\n".join(json.dumps(row) for row in rows)  # one option a line: a new tag's diff reads per option
    OUT.write_text(json.dumps(head)[:-1] + ', "options": [\n' + lines + "\n]}\n")
    print(f"wrote {OUT}: {len(rows)} options")


if __name__ == "__main__":
    main(sys.argv[1])
