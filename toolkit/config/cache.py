"""Where parakit keeps what it makes once and reuses: the bundled corpus (`PARAKIT_CACHE`) and
the planner's measurement of this machine (`PARAKIT_CACHE_DIR`), both under one root."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """A checkout's ignored .cache/ when parakit runs from one; else parakit's folder in the user's
    cache directory (an installed package must not write into site-packages)."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        return checkout / ".cache"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "parakit"


def data_cache() -> Path:
    """The prepared corpus, the bundled tokenizer's files and the sample indices: $PARAKIT_CACHE, else
    cache_root()."""
    return Path(os.environ.get("PARAKIT_CACHE") or cache_root())
