"""Writing a Hugging Face model directory as a stream: safetensors shards of at most
`max_shard_bytes` (plus model.safetensors.index.json when there are several), each written as
soon as it is full, so that no more than one shard is held; and the directory published only
when complete.

Shard names follow transformers' save_pretrained: model.safetensors alone, or
model-00001-of-0000N.safetensors with an index mapping every tensor to its file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from toolkit.formats.atomic import file_mode, fsync_path

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes -> bytes (save_pretrained's max_shard_size)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not found or found[2].upper() not in _UNITS or float(found[1]) <= 0:
        raise ValueError(f"{text!r} is not a size: use e.g. 5GB, 500MB or 2GiB")
    return int(float(found[1]) * _UNITS[found[2].upper()])


class ShardWriter:
    """Tensors in, safetensors shards out; `finish()` names the shards and writes the index."""

    def __init__(self, directory: Path, max_shard_bytes: int):
        self.directory, self.max_shard_bytes = directory, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []  # tensor names of each written shard
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self._write_pending()
        # No copy: safetensors writes straight from each tensor's memory and accepts disjoint views
        # of one storage (q, k, v cut from the fused QKV), so a shard costs its own size only.
        tensor = tensor.detach().to("cpu")
        self.pending[name] = tensor if tensor.is_contiguous() else tensor.contiguous()
        self.pending_bytes += nbytes

    def _write_pending(self) -> None:
        from safetensors.torch import save_file

        path = self.directory / f".shard-{len(self.shards):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        os.chmod(path, file_mode())  # safetensors creates it owner-only; the other files follow the umask
        fsync_path(path)
        self.shards.append(list(self.pending))
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[Path]:
        """Write the last shard, give the shards their final names (and the index); the files."""
        if self.pending or not self.shards:
            self._write_pending()
        count = len(self.shards)
        names = (
            ["model.safetensors"]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        for i, name in enumerate(names):
            os.replace(self.directory / f".shard-{i:05d}.safetensors", self.directory / name)
        files = [self.directory / n for n in names]
        if count > 1:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": {tensor: names[i] for i, shard in enumerate(self.shards) for tensor in shard},
            }
            path = self.directory / "model.safetensors.index.json"
            path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            files.append(path)
        return files
