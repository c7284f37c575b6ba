"""Write docs/configuration.md (every configuration field, from the schema) and docs/commands.md
(every command's options, from the argument parsers); tests/test_reference_docs.py fails when
either is out of date.

    python scripts/gen_reference_docs.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from toolkit.cli import command_reference  # noqa: E402
from toolkit.config.reference import configuration_reference  # noqa: E402

DOCS = {"configuration.md": configuration_reference, "commands.md": command_reference}


def main() -> int:
    for name, make in DOCS.items():
        path = ROOT / "docs" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(make())
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
