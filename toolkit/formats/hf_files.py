"""The weight files of a local Hugging Face model directory, by the names transformers'
save_pretrained gives them (transformers/utils/__init__.py: SAFE_WEIGHTS_INDEX_NAME,
SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME).

Pure Python (json only): the validator lists them before any rank starts, and the megatron
ranks read the same list (toolkit.families.hf_weights.HfTensors).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from toolkit.formats.hf_arch import HfConfigError

# format -> (the index of a sharded checkpoint, the file(s) of an unsharded one). Safetensors files
# of any name, as HfTensors has always read them; transformers' from_pretrained also reads PyTorch's.
FORMATS = {
    "safetensors": ("model.safetensors.index.json", "*.safetensors"),
    "pytorch_bin": ("pytorch_model.bin.index.json", "pytorch_model.bin"),
}


def _shards(index: Path, path) -> list[str]:
    """The files an index's weight_map names (tensor -> file)."""
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise HfConfigError(
            f"model.hf_path={path}: {index.name} is not an index of weight files ({type(e).__name__}: {e}); "
            "save the model again with save_pretrained, or remove the index if the weights are one file"
        ) from None


def weight_files(path: str | os.PathLike, formats: tuple[str, ...] = ("safetensors",)) -> list[Path]:
    """The weight files of directory `path` in the first of `formats` it holds: the shards its
    index names (each must be there), else the unsharded file(s). HfConfigError naming
    model.hf_path, what is missing and the fix otherwise."""
    directory = Path(path).expanduser()
    for name in formats:
        index, unsharded = FORMATS[name]
        if (directory / index).is_file():
            shards = _shards(directory / index, path)
            missing = [s for s in shards if not (directory / s).is_file()]
            if missing:
                listing = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                raise HfConfigError(
                    f"model.hf_path={path}: {index} names {listing}, which {'is' if len(missing) == 1 else 'are'} "
                    "not in the directory; copy (or download) every shard the index names into it"
                )
            return [directory / s for s in shards]
        files = sorted(directory.glob(unsharded))
        if files:
            return files
    looked_for = " or ".join(f"{index} or {unsharded}" for index, unsharded in (FORMATS[n] for n in formats))
    raise HfConfigError(
        f"model.hf_path={path}: no weights in it (no {looked_for}); save the model there with save_pretrained "
        "(safetensors is its default) or copy its weight files in, or start from train.init_checkpoint=DIR"
    )
