"""Training checkpoints read as a stream of transformers tensors (name, tensor), one transformer
layer at a time, by the libraries' own readers.

- megatron-core dist checkpoints (any tp/pp/vpp/dp layout): the tensors are stored layout-free
  (global shapes, layers stacked on a leading axis) in torch.distributed.checkpoint's format, so
  torch reassembles one layer of every stacked tensor at a time in this one process. The vocabulary rows are the saved
  layout's padding (which older checkpoints took from tp): they are read as saved and cut to model.vocab_size.
- DeepSpeed ZeRO-3: deepspeed.utils.zero_to_fp32 in lazy mode (optimizer partitions memory-mapped,
  each parameter gathered when asked for).
- DeepSpeed ZeRO 0-2: the engine's module states (full parameters), memory-mapped.
- DeepSpeed pipeline: one layer_XX-model_states.pt per PipelineModule layer
  (toolkit.train.deepspeed_pipe names them).

Tensors keep the dtype the model trained in; ZeRO-3's fp32 master weights are cast to it, which
is what the engine's own module held. A megatron tensor stored in a dtype other than most of the
model's joins theirs only where the cast is exact.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import warnings
from collections import Counter
from pathlib import Path
from typing import Iterator

import torch

from toolkit.config.schema import ModelConfig
from toolkit.families import family_of
from toolkit.families.to_hf import NAMED_LAYER, megatron_layer_to_hf, megatron_outer_to_hf

Tensors = Iterator[tuple[str, torch.Tensor]]
_LAYERS = "decoder.layers."


def _layer_tensors(named: dict) -> dict:
    """One layer's stored tensors -> the local spec's names: an MoE layer's experts are one tensor
    with the global expert index first (mlp.experts.experts.linear_fc1.weight), the local spec's
    SequentialMLP holds mlp.experts.local_experts.{e}.linear_fc1.weight."""
    out = {}
    for key, tensor in named.items():
        if key.startswith("mlp.experts.experts."):
            for e, part in enumerate(tensor):
                out[f"mlp.experts.local_experts.{e}.{key[len('mlp.experts.experts.') :]}"] = part
        else:
            out[key] = tensor
    return out


def _slice_planner(offsets: dict):
    """torch.distributed.checkpoint's default load planner, asked for part of each tensor: the
    destination of `key` is the block of its shape at `offsets[key]` of the stored tensor."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SlicePlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, tensor in self.state_dict.items():
                wanted = ChunkStorageMetadata(offsets=torch.Size(offsets[key]), sizes=tensor.size())
                items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [wanted])
            return LoadPlan(items)

        def lookup_tensor(self, index):  # by name: the destination is a plain tensor, not a shard
            return self.state_dict[index.fqn]

    return SlicePlanner()


def megatron_tensors(directory: Path, m: ModelConfig) -> Tensors:
    """The transformers tensors of a megatron-core dist checkpoint's model (optimizer ignored).

    megatron-core's torch_dist format is torch.distributed.checkpoint's: torch reads it here in
    this one process (no process group), layer `i` of every stacked tensor at a time. Only the
    stored chunks that overlap it are read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    backend = json.loads((directory / "metadata.json").read_text()).get("sharded_backend")
    if backend != "torch_dist":
        raise ValueError(f"{directory} is a {backend!r} dist checkpoint; only megatron-core's torch_dist is read")
    reader = dcp.FileSystemReader(str(directory))
    stored = {
        key: meta
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata) and not key.startswith("optimizer.")
    }
    stacked = {key: meta for key, meta in stored.items() if key.startswith(_LAYERS) and not NAMED_LAYER.match(key)}
    wrong = {key: tuple(meta.size) for key, meta in stacked.items() if meta.size[0] != m.num_layers}
    if wrong:
        raise ValueError(f"{directory} holds layer tensors of another depth than num_layers={m.num_layers}: {wrong}")
    sizes = Counter()
    for meta in stored.values():
        sizes[meta.properties.dtype] += meta.size.numel()
    yield from _in_one_dtype(_megatron_tensors(reader, stored, m), max(sizes, key=sizes.get))


def _in_one_dtype(tensors: Tensors, dtype: torch.dtype) -> Tensors:
    """A tensor of another floating dtype than most of the model's (norms a converter kept in fp32
    beside bf16 matrices) in that dtype when the cast is exact, so that the directory has one dtype
    as transformers' own; else as it is (nothing is rounded)."""
    for name, tensor in tensors:
        if tensor.is_floating_point() and tensor.dtype != dtype:
            cast = tensor.to(dtype)
            if torch.equal(cast.to(tensor.dtype), tensor):
                tensor = cast
        yield name, tensor


def _megatron_tensors(reader, stored: dict, m: ModelConfig) -> Tensors:
    import torch.distributed.checkpoint as dcp

    stacked = {key: meta for key, meta in stored.items() if key.startswith(_LAYERS) and not NAMED_LAYER.match(key)}

    def load(templates: dict, offsets: dict) -> dict:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*load in a single process.*")
            dcp.load(templates, storage_reader=reader, planner=_slice_planner(offsets), no_dist=True)
        return templates

    def outer(keys) -> Tensors:
        for key in keys:
            whole = torch.empty(stored[key].size, dtype=stored[key].properties.dtype)
            yield from megatron_outer_to_hf(key, load({key: whole}, {key: (0,) * whole.dim()})[key], m).items()

    # In the model's order (embedding, layers, final norm, output layer): shards then hold
    # neighbouring tensors, as transformers' own.
    yield from outer(k for k in stored if k.startswith("embedding."))
    for i in range(m.num_layers):
        layer = {key: torch.empty((1, *meta.size[1:]), dtype=meta.properties.dtype) for key, meta in stacked.items()}
        load(layer, {key: (i,) + (0,) * (len(meta.size) - 1) for key, meta in stacked.items()})
        tensors = {k[len(_LAYERS) :]: v[0] for k, v in layer.items()}
        named = {key: meta for key, meta in stored.items() if key.startswith(f"{_LAYERS}{i}.")}
        whole = load(
            {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in named.items()},
            {key: (0,) * len(meta.size) for key, meta in named.items()},
        )
        tensors.update(_layer_tensors({k[len(f"{_LAYERS}{i}.") :]: v for k, v in whole.items()}))
        yield from megatron_layer_to_hf(tensors, i, m).items()
        del layer, whole
    yield from outer(k for k in stored if not k.startswith(("embedding.", _LAYERS)))


def deepspeed_tensors(state_dir: Path, m: ModelConfig) -> Tensors:
    """The transformers tensors of a DeepSpeed engine checkpoint (one tag's directory), under the
    family's names on disk (a mixture of experts' fused experts split expert by expert)."""
    layer_files = sorted(state_dir.glob("layer_*-model_states.pt"), key=lambda p: int(re.findall(r"\d+", p.name)[0]))
    if layer_files:
        return _pipeline_tensors(layer_files, m)
    if (state_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt").exists():
        return _on_disk(_zero3_tensors(state_dir), m)
    if (state_dir / "mp_rank_00_model_states.pt").exists():
        return _on_disk(_module_tensors(state_dir / "mp_rank_00_model_states.pt"), m)
    raise FileNotFoundError(f"{state_dir} holds no DeepSpeed model states (*_model_states.pt)")


def _on_disk(tensors: Tensors, m: ModelConfig) -> Tensors:
    family = family_of(m.family)
    for name, tensor in tensors:
        yield from family.on_disk(name, tensor).items()


def _module_tensors(path: Path) -> Tensors:
    # mmap: a tensor is read from disk when it is copied into a shard, not before.
    yield from torch.load(path, map_location="cpu", mmap=True, weights_only=False)["module"].items()


def _zero3_tensors(state_dir: Path) -> Tensors:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    placeholders = torch.load(state_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)["module"]
    dtype = next(t.dtype for t in placeholders.values() if t.is_floating_point())  # the engine's module dtype
    with contextlib.redirect_stdout(io.StringIO()):  # its progress notes say nothing to an export
        lazy = get_fp32_state_dict_from_zero_checkpoint(str(state_dir.parent), tag=state_dir.name, lazy_mode=True)
    for name in list(lazy):
        tensor = lazy.pop(name).contiguous()
        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


def _pipeline_tensors(layer_files: list[Path], m: ModelConfig) -> Tensors:
    from toolkit.train.deepspeed_pipe import hf_parameter_name

    if len(layer_files) != m.num_layers + 2:
        raise ValueError(
            f"{layer_files[0].parent} holds {len(layer_files)} pipeline layer files; model {m.name} has "
            f"{m.num_layers + 2} (embedding, {m.num_layers} decoder layers, head)"
        )
    for index, path in enumerate(layer_files):
        for key, tensor in torch.load(path, map_location="cpu", mmap=True, weights_only=False).items():
            name = hf_parameter_name(m, index, key)
            if name is not None:
                yield name, tensor
