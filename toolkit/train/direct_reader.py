"""torch.distributed.checkpoint's file reader with each whole tensor record read straight into the
tensor it loads into.

DCP's FileSystemReader (torch/distributed/checkpoint/filesystem.py, read_data) torch.loads every
tensor record into a new tensor and copies that into the destination: on CPU the new tensor's
pages are touched for the first time and then copied, twice the memory traffic of the read itself
(profiled on a 2 GB megatron checkpoint: a third of the load). Where a record holds a
contiguous tensor of the destination's dtype and the destination is a contiguous CPU
tensor, this reader reads the record's bytes into the destination (one copy, from the page cache;
also where the destination takes whole rows of the record);
every other item takes DCP's way. Megatron-core builds its reader inside its load strategy, so
`direct_reads()` hands it this one for the duration of a load.

The same holds after the read: megatron-core loads a SwiGLU fc1 weight as its two halves, read
into two views of the destination, and merges them with torch.cat into a new tensor (mlp.py,
apply_swiglu_sharded_factory), which the model then copies back over the same memory: on CPU 0.1 s
per 32 MB (fresh pages), a quarter of a 2-rank load; on a GPU a second copy of the weight.
`merge_adjacent` returns the destination itself where the halves lie end to end in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType

READ_THREADS = 4


class DirectFileSystemReader(FileSystemReader):
    def read_data(self, plan, planner) -> torch.futures.Future:
        by_file: dict[str, list] = {}
        others = []
        for item in plan.items:
            if item.type == LoadItemType.TENSOR and not self.storage_data[item.storage_index].transform_descriptors:
                by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            else:
                others.append(item)
        # the files at once: a disk serves several reads in flight faster than one (readinto frees the GIL)
        with ThreadPoolExecutor(max(1, min(READ_THREADS, len(by_file)))) as pool:
            list(pool.map(lambda entry: self._read_file(*entry, planner), by_file.items()))
        if others:
            return super().read_data(dataclasses.replace(plan, items=others), planner)
        done: torch.futures.Future = torch.futures.Future()  # what DCP's load waits on (not concurrent's)
        done.set_result(None)
        return done

    def _read_file(self, relative_path: str, items: list, planner) -> None:
        with open(Path(self.path) / relative_path, "rb", buffering=0) as file:
            for item in items:
                self._load_tensor(file, item, planner)

    def _load_tensor(self, file, item, planner) -> None:
        info = self.storage_data[item.storage_index]
        target = planner.resolve_tensor(item).detach()
        offset = self._direct_offset(file, info, item, target)
        if offset is None:  # DCP's own way: torch.load the record, narrow it, copy it in
            record = torch.load(self._slice_file(file, info), map_location="cpu", weights_only=True)
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                record = record.narrow(dim, start, length)
            target.copy_(record)
        else:
            file.seek(info.offset + offset)
            view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
            done = 0
            while done < len(view):
                read = file.readinto(view[done:])
                if not read:
                    raise OSError(f"{file.name}: the file ends inside a tensor record")
                done += read
        planner.commit_tensor(item, target)

    def _direct_offset(self, file, info, item, target: torch.Tensor) -> int | None:
        """Where, in the file's record, the bytes the destination takes start; None where they are
        not one contiguous run (a slice of the record other than whole rows of its first dimension:
        what another data-parallel size reads of a flat optimizer shard is) or the destination is
        not a contiguous CPU tensor of the same dtype."""
        if sys.byteorder != "little" or target.device.type != "cpu" or not target.is_contiguous():
            return None
        # the record's tensor without its data: shape, dtype, strides and its bytes' offset
        record = torch.load(self._slice_file(file, info), map_location="meta", weights_only=True)
        offset = getattr(record.untyped_storage(), "_checkpoint_offset", None)
        starts, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        rows = not any(starts[1:]) and lengths[1:] == tuple(record.shape[1:])
        contiguous = record.is_contiguous() and record.storage_offset() == 0
        if offset is None or not (rows and contiguous and record.dtype == target.dtype and target.shape == lengths):
            return None
        first = starts[0] * record.stride(0) if record.dim() else 0
        return offset + first * record.element_size()


def merge_adjacent(pieces: list[torch.Tensor], concatenate) -> torch.Tensor:
    """The tensor `pieces` make along their first dimension: a view of the tensor they are views
    of where they lie end to end in it (contiguous, in order, nothing between), else
    `concatenate(pieces)` (a new tensor)."""
    first = pieces[0]
    offset = first.storage_offset()
    for piece in pieces:
        adjacent = (
            piece.dim() > 0
            and piece.is_contiguous()
            and piece.dtype == first.dtype
            and piece.device == first.device
            and piece.shape[1:] == first.shape[1:]
            and piece.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and piece.storage_offset() == offset
        )
        if not adjacent:
            return concatenate(pieces)
        offset += piece.numel()
    rows = sum(piece.shape[0] for piece in pieces)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


@contextlib.contextmanager
def direct_reads():
    """Megatron-core's torch_dist load strategy reads through DirectFileSystemReader meanwhile, and
    the sharded state dicts built meanwhile merge SwiGLU halves with merge_adjacent."""
    from megatron.core.dist_checkpointing.strategies import torch as strategies
    from megatron.core.transformer import mlp

    built = strategies._get_filesystem_reader

    def reader(checkpoint_dir, cache_metadata: bool = False, **kwargs):
        if cache_metadata:  # its cached-metadata reader is another class: keep it
            return built(checkpoint_dir, cache_metadata=cache_metadata, **kwargs)
        return DirectFileSystemReader(checkpoint_dir)

    concatenate = mlp.cat_with_oom_fallback
    strategies._get_filesystem_reader = reader
    mlp.cat_with_oom_fallback = lambda pieces: merge_adjacent(pieces, concatenate)
    try:
        yield
    finally:
        strategies._get_filesystem_reader = built
        mlp.cat_with_oom_fallback = concatenate
