"""No password in a configuration value: every value is written into config.yaml, Hydra's files,
the trackers and the log (toolkit.config.secrets)."""

from __future__ import annotations

from typing import Iterator

from toolkit.config.schema import Config, plain
from toolkit.config.secrets import credentials_fix, has_password, masked
from toolkit.plan.rules.base import Violation, err


def _texts(value, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _texts(inner, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, inner in enumerate(value):
            yield from _texts(inner, f"{path}[{i}]")
    elif isinstance(value, str):
        yield path, value


def passwords(cfg: Config) -> Iterator[Violation]:
    """Any text field holding a URI with user:password@."""
    for path, text in _texts(plain(cfg), ""):
        if has_password(text):
            yield err(
                "password",
                {path: masked(text)},
                "holds a password (user:password@ in a URI), which parakit would write into config.yaml, Hydra's "
                ".hydra/ files, the trackers' parameters and its log",
                credentials_fix(path),
            )
