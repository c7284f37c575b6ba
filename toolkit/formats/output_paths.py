"""Where a command writes, checked before it starts work: a folder it writes into must be a folder
(or creatable: no file on the way), writable, and, where the command writes a new one whole, not
there yet. Each problem names the path, so that nothing is computed only to fail at the end."""

from __future__ import annotations

import os
from pathlib import Path


def folder_problem(path: str | Path, *, new: bool = False) -> str | None:
    """Why `path` cannot be the folder a command writes, or None. `new`: the command publishes the
    folder whole (export, convert), so it must not exist yet; otherwise an existing folder is
    written into and a missing one is made."""
    folder = Path(path).expanduser()
    if new and (folder.exists() or folder.is_symlink()):
        return f"{folder} already exists: choose another folder or remove it first"
    for existing in (folder, *folder.parents):
        if existing.exists():
            if not existing.is_dir():
                return f"{existing} is a file, not a folder"
            if not os.access(existing, os.W_OK | os.X_OK):
                return f"{existing} is not writable"
            return None
    return None


def file_problem(path: str | Path) -> str | None:
    """Why a file cannot be written at `path` (its folder made if missing), or None."""
    target = Path(path).expanduser()
    if target.is_dir():
        return f"{target} is a folder, not a file"
    return folder_problem(target.parent)
