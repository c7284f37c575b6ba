"""The weights a run starts from: a Hugging Face directory that matches the model and holds its
weight files, an initial megatron-core checkpoint that is one; checked before any rank opens them."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from toolkit.config.schema import Config
from toolkit.families import hf_config
from toolkit.formats import hf_arch, hf_files
from toolkit.plan.backends import backend_of
from toolkit.plan.rules.base import Violation, err


def hf_path(cfg: Config) -> Iterator[Violation]:
    """The weights of model.hf_path fit the configured model (its config.json, read as json)."""
    m = cfg.model
    if not m.hf_path:
        return
    try:
        diff = hf_config.mismatches(m, m.hf_path)
    except hf_arch.HfConfigError as e:
        what, _, fix = str(e).partition("; ")
        yield err("hf_path", {"model.hf_path": m.hf_path}, what.removeprefix(f"model.hf_path={m.hf_path}: "), fix)
        return
    if diff:
        yield err(
            "hf_path_architecture",
            {"model.hf_path": m.hf_path, **{f"model.{name}": ours for name, (ours, _) in diff.items()}},
            f"its config.json describes another model (configured vs config.json): {hf_config.describe(diff)}",
            hf_config.MISMATCH_FIX.format(path=m.hf_path),
        )


def hf_weights(cfg: Config) -> Iterator[Violation]:
    """The weight files every rank opens in model.hf_path are there (toolkit.formats.hf_files: the
    list HfTensors reads, and the names transformers' from_pretrained looks for), unless
    train.init_checkpoint replaces them (megatron_backend's setup loads one or the other)."""
    m, formats = cfg.model, backend_of(cfg).hf_weights
    if not m.hf_path or cfg.train.init_checkpoint or not formats or not Path(m.hf_path).expanduser().is_dir():
        return  # no such directory: hf_path says so
    try:
        hf_files.weight_files(m.hf_path, formats)
    except hf_arch.HfConfigError as e:
        what, _, fix = str(e).partition("; ")
        yield err("hf_weights", {"model.hf_path": m.hf_path}, what.removeprefix(f"model.hf_path={m.hf_path}: "), fix)


SEALED = "manifest.json"  # the file list and checksums a sealed checkpoint carries (toolkit.train.checkpoint.seal)


def init_checkpoint(cfg: Config) -> Iterator[Violation]:
    """train.init_checkpoint is a megatron-core dist checkpoint (its metadata.json is there:
    megatron/core/dist_checkpointing/core.py, check_is_distributed_checkpoint) that parakit sealed:
    its manifest lists every file's checksum, which the ranks verify before they read any of it
    (.metadata is a pickle: nothing unverified is unpickled). Checked before any rank starts."""
    path = cfg.train.init_checkpoint
    if not path:
        return
    if not Path(path).is_dir():
        what = "no such directory"
    elif not (Path(path) / "metadata.json").is_file():
        what = "no megatron-core dist checkpoint there (no metadata.json)"
    elif not (Path(path) / SEALED).is_file():
        what = (
            f"no {SEALED} there (written by parakit before it sealed initial checkpoints, or by another tool): its "
            ".metadata is a pickle that nothing verifies"
        )
    else:
        return
    yield err(
        "init_checkpoint",
        {"train.init_checkpoint": path},
        what,
        "point it at a directory train.save_init_checkpoint wrote, or convert Hugging Face weights: "
        "parakit convert hf-to-megatron HF_DIR --output DIR",
    )
