"""Hugging Face weights into megatron-core GPTModel chunks at any tp/pp/vpp layout, read tensor by
tensor; which Hugging Face tensors make a megatron one is the model family's (toolkit.families).

Each rank asks megatron-core what it holds: `chunk.sharded_state_dict()` names every tensor by
its checkpoint key (layer-stacked, Transformer Engine names: `decoder.layers.self_attention.
linear_qkv.layer_norm_weight` is the input norm) and gives the global shape and this rank's
offsets in it, after the same factories dist_checkpointing.load applies (SwiGLU's fc1 becomes
its gate and up halves, each split over tp). For each of those tensors this module builds the
global megatron tensor of one layer from the Hugging Face tensors (safetensors' safe_open, one
tensor at a time), cuts this rank's slice out of it, merges it with megatron-core's own factory
merge and copies it into the parameter before the next one is read. So the extra host memory
while loading is about one global tensor (plus its slice), never the whole model
(scripts/bench_hf_memory.py measures it).

Layouts (megatron-core's): linear_qkv rows are grouped per KV group, [q heads of group 0, k of
group 0, v of group 0, q heads of group 1, ...] (megatron/core/transformer/attention.py,
SelfAttention.get_query_key_value_tensors); linear_fc1 of SwiGLU is [gate; up]; GPT-2's Conv1D
stores weights as [in, out], transposed to torch.nn.Linear's [out, in]. The embedding and output
layer are read by rows, only this rank's; the rows beyond the tokenizer's vocabulary (padding to
make_vocab_size_divisible_by) are zero.
"""

from __future__ import annotations

import torch

from toolkit.config.schema import ModelConfig
from toolkit.families import family_of
from toolkit.families.hf_config import check_matches
from toolkit.families.to_hf import NAMED_LAYER
from toolkit.formats.hf_arch import HfConfigError
from toolkit.formats.hf_files import weight_files


class HfTensors:
    """The tensors of a Hugging Face directory, each read when asked for. A file is mapped only
    while one tensor is copied out of it (safe_open), so that neither the process's memory nor
    its resident mapped pages grow towards the model's size as the tensors go by."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        self._where: dict[str, str] = {}
        for file in weight_files(path):  # the validator checked the same list before the ranks started
            with safe_open(str(file), framework="pt") as handle:  # reads the header only
                self._where.update(dict.fromkeys(handle.keys(), str(file)))

    def _name(self, name: str) -> str | None:
        # Older GPT-2 checkpoints (openai-community/gpt2) store the body without `transformer.`.
        for candidate in (name, name.removeprefix("transformer.")):
            if candidate in self._where:
                return candidate
        return None

    def _found(self, name: str) -> str:
        found = self._name(name)
        if found is None:
            raise HfConfigError(f"model.hf_path={self.path}: no tensor {name!r} in its safetensors files")
        return found

    def get(self, name: str, rows: tuple[int, int] | None = None, dtype=torch.float32) -> torch.Tensor:
        """Tensor `name`, or only its rows [start, stop) (read from the file without the rest)."""
        from safetensors import safe_open

        found = self._found(name)
        with safe_open(self._where[found], framework="pt") as handle:
            if rows is None:
                return handle.get_tensor(found).to(dtype)
            return handle.get_slice(found)[rows[0] : rows[1]].to(dtype)

    def shape(self, name: str) -> tuple[int, ...]:
        from safetensors import safe_open

        found = self._found(name)
        with safe_open(self._where[found], framework="pt") as handle:
            return tuple(handle.get_slice(found).get_shape())


def _vocab_part(sh, hf: HfTensors, m: ModelConfig) -> torch.Tensor:
    """This rank's rows of the embedding or output layer that the tokenizer's vocabulary has,
    reading only those rows: the largest tensor of most models, so each of tp ranks on a node
    reads 1/tp of it. The padding rows past them (to make_vocab_size_divisible_by) are left
    to the caller, which zeroes them in the parameter itself (no padded copy)."""
    name = family_of(m.family).vocab_name(sh.key, m)
    rows, hidden = hf.shape(name)
    if hidden != sh.global_shape[-1] or rows > sh.global_shape[0]:
        raise HfConfigError(
            f"{sh.key}: the Hugging Face weights give shape {(rows, hidden)}, the model expects "
            f"{tuple(sh.global_shape)} (padded); check that the model fields match the directory's config.json"
        )
    start = sh.global_offset[0]
    stop = max(start, min(start + sh.local_shape[0], rows))
    return hf.get(name, rows=(start, stop), dtype=sh.data.dtype)


def megatron_tensor(
    key: str, layer: int | None, hf: HfTensors, m: ModelConfig, expert: int | None = None
) -> torch.Tensor:
    """The global megatron-core tensor of checkpoint key `key` (of decoder layer `layer`, and
    `expert` of an MoE layer) built from the Hugging Face tensors (the embedding and output
    layer: _vocab_part)."""
    t = family_of(m.family).megatron_tensor(key, layer, hf, m, expert)
    if t is None:
        raise HfConfigError(
            f"model.hf_path={hf.path}: megatron-core tensor {key!r} has no Hugging Face counterpart for "
            f"family={m.family}; check that the model fields match the directory's config.json"
        )
    return t


def _local_slice(sh, global_tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a global tensor: the ShardedTensor's offsets after its prepended
    (layer) axes, its local shape."""
    if sh.flattened_range is not None:
        raise NotImplementedError("flattened (distributed-optimizer) shards are not model parameters")
    n = sh.prepend_axis_num
    if tuple(global_tensor.shape) != tuple(sh.global_shape[n:]):
        raise HfConfigError(
            f"{sh.key}: the Hugging Face weights give shape {tuple(global_tensor.shape)}, the model expects "
            f"{tuple(sh.global_shape[n:])}; check that the model fields match the directory's config.json"
        )
    index = tuple(slice(o, o + s) for o, s in zip(sh.global_offset[n:], sh.local_shape))
    part = global_tensor[index].to(sh.data.dtype)
    # A slice keeps the whole global tensor alive: copy it out (not needed for all of it).
    return part.clone() if part.numel() != global_tensor.numel() else part


_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _coordinates(sh) -> tuple[str, int | None, int | None]:
    """(layer-free key, layer, expert) of a ShardedTensor. Layers are stacked along a prepended
    axis (`decoder.layers.X`), or named one by one when their kinds differ (`decoder.layers.3.X`:
    a model of dense and MoE layers, megatron-core's moe_layer_freq as a list); an MoE layer's
    experts are one more prepended axis (SequentialMLP's global expert index)."""
    offsets = list(sh.global_offset[: sh.prepend_axis_num])
    named = NAMED_LAYER.match(sh.key)
    key, layer = (f"decoder.layers.{named.group(2)}", int(named.group(1))) if named else (sh.key, None)
    if layer is None and offsets and sh.key.startswith("decoder.layers."):
        layer = offsets.pop(0)
    return key, layer, (offsets[0] if offsets else None)


@torch.no_grad()
def load_hf_into_chunks(chunks: list, path: str, m: ModelConfig) -> None:
    """Fill this rank's GPTModel chunks with the weights of the Hugging Face directory `path`,
    reading only the tensors the chunks hold, one parameter at a time: each is built, copied into
    the chunk's parameter and dropped before the next is read."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    check_matches(m, path)
    hf = HfTensors(path)
    last: dict = {}  # the last global tensor built: SwiGLU's gate and up halves share one

    def fill(value):
        if not isinstance(value, ShardedTensor):
            return value
        if value.key in _VOCAB_KEYS:
            return _vocab_part(value, hf, m)
        key, layer, expert = _coordinates(value)
        if last.get("id") != (key, layer, expert):
            last.clear()  # drop the previous one first: at most one global tensor alive
            last.update(id=(key, layer, expert), tensor=megatron_tensor(key, layer, hf, m, expert))
        return _local_slice(value, last["tensor"])

    for chunk in chunks:
        targets = {k: v for k, v in chunk.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
        sharded, _, factories = load_preprocess(chunk.sharded_state_dict())
        sharded = {k: v for k, v in sharded.items() if not k.endswith("_extra_state")}
        if set(sharded) != set(targets):  # every parameter filled, nothing else
            raise RuntimeError(f"sharded state dict and parameters differ: {sorted(set(sharded) ^ set(targets))}")
        for name in list(sharded):
            # megatron-core's own factory merge (SwiGLU: cat of the gate and up halves), one entry.
            loaded = apply_factory_merges(
                dict_list_map_inplace(fill, {name: sharded.pop(name)}),
                {name: factories[name]} if name in factories else {},
            )[name]
            target = targets[name]
            if loaded.shape != target.shape and name not in _VOCAB_KEYS:
                raise RuntimeError(f"{name}: built {tuple(loaded.shape)} for a parameter of {tuple(target.shape)}")
            target[: loaded.shape[0]].copy_(loaded)
            target[loaded.shape[0] :].zero_()  # vocabulary padding rows
            del loaded
        last.clear()
