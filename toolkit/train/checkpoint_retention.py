"""Which checkpoints a run keeps, and what it clears away.

Under checkpoint.dir: the published checkpoints (`step_*`), the ones set aside (`.step_N.rejected`:
failed verification at a resume; `.step_N.replaced`: a step published again over it), staging
folders of saves that never finished (`.step_N.partial`) and DeepSpeed's universal conversions
(`.universal/step_N`). Pruning, after each publication:
- keeps the `keep_last` checkpoints published last, counted in publication order (the `sequence`
  each manifest records), not by name: a resume from step 2 past a damaged step 4 publishes
  step 3 after it;
- never deletes the checkpoint just published nor the one this run resumed from;
- keeps at most max(keep_last, 1) set-aside checkpoints (the newest), removes staging folders of
  other steps and universal conversions whose checkpoint is gone;
- says what it could not remove (a symbolic link it does not follow, a permission) instead of
  passing over it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

MANIFEST = "manifest.json"
SET_ASIDE = ("rejected", "replaced")  # why a checkpoint was set aside: its name's last part
UNIVERSAL = ".universal"  # DeepSpeed's universal conversions (toolkit.train.deepspeed_checkpoint)


def sequence(directory: Path) -> int:
    """The publication number the checkpoint's manifest records (-1: none recorded, or unreadable)."""
    try:
        return int(json.loads((directory / MANIFEST).read_text()).get("sequence", -1))
    except (OSError, ValueError, TypeError, AttributeError):
        return -1


def published_in_order(root: Path) -> list[Path]:
    """The published checkpoints under `root`, the first published first (name breaks ties)."""
    return sorted(root.glob("step_*"), key=lambda p: (sequence(p), p.name))


def next_sequence(root: Path) -> int:
    return 1 + max((sequence(p) for p in root.glob("step_*")), default=0)


def set_aside(directory: Path, why: str) -> Path:
    """Rename a published checkpoint out of the resumable ones (`step_*`), its files kept:
    <root>/.step_00000042.<why> (a number added when that is taken); `why` is rejected or replaced."""
    target, n = directory.with_name(f".{directory.name}.{why}"), 1
    while target.exists():
        n += 1
        target = directory.with_name(f".{directory.name}.{why}{n}")
    os.replace(directory, target)
    return target


def remove_stale_staging(root: Path, staging: Path) -> None:
    """(before a save) The staging folders of saves that never finished, but `staging` (this save's)."""
    for old in root.glob(".step_*.partial"):
        if old != staging:
            remove(old, "the staging folder of a save that did not finish")


def prune(root: Path, keep_last: int, keep: tuple[Path, ...] = ()) -> None:
    """(rank 0, after a publication) Delete what the module's rules do not keep; `keep`: the
    checkpoints never deleted (the one just published, the one the run resumed from)."""
    kept = {p.resolve() for p in keep}
    published = published_in_order(root)
    if keep_last > 0:
        for old in published[:-keep_last]:
            if old.resolve() not in kept:
                remove(old, f"older than the last checkpoint.keep_last={keep_last}")
    aside = sorted(
        (p for p in root.glob(".step_*") if p.name.rsplit(".", 1)[-1].rstrip("0123456789") in SET_ASIDE),
        key=lambda p: p.lstat().st_ctime,  # the rename that set it aside
    )
    for old in aside[: -max(keep_last, 1)]:
        remove(old, "set aside earlier than the newest kept")
    universal = root / UNIVERSAL
    for converted in universal.glob("*") if universal.is_dir() else []:
        if not (root / converted.name).is_dir():  # its checkpoint pruned, or a staging folder left over
            remove(converted, "a universal conversion of a checkpoint no longer kept")


def remove(path: Path, why: str) -> bool:
    """Delete a checkpoint folder; what stops it (a symbolic link, which is not followed; a
    permission) is said on stderr with the fix, never passed over. Whether it is gone."""
    problems = []
    if path.is_symlink():
        problems.append(f"it is a symbolic link to {os.readlink(path)} (not followed)")
    else:
        _rmtree(path, lambda name, error: problems.append(f"{name}: {_reason(error)}"))
    if problems:
        print(
            f"warning [prune] could not remove {path} ({why}): {problems[0]}"
            f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}. Fix: remove it yourself, or "
            "give the run a checkpoint.dir it owns",
            file=sys.stderr,
            flush=True,
        )
    return not problems


def _rmtree(path: Path, failed) -> None:
    """shutil.rmtree that hands each failure to `failed(name, error)` and goes on (onexc from
    Python 3.12, onerror before)."""
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda _, name, error: failed(name, error))
    else:
        shutil.rmtree(path, onerror=lambda _, name, info: failed(name, info[1]))


def _reason(error: BaseException) -> str:
    return error.strerror if isinstance(error, OSError) and error.strerror else str(error)
