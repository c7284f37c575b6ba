"""Initial weights of megatron-core chunks that depend on the seed alone, never on the layout.

megatron-core draws each rank's weights from its own RNG stream: offset by the pipeline stage
(Megatron-LM's _set_random_seed: seed + 100 * pp_rank), by the tensor-parallel rank on GPUs
(tensor_parallel/random.py: seed + 2718 + tp_rank) and by the expert-parallel rank for experts,
in the order the modules are built. So tp=2, pp=2 or ep=2 starts from other weights than tp=1,
and their loss curves cannot be compared. Here every weight matrix is drawn again, whole, from
a generator seeded by the run's seed and the tensor's layout-free name in the sharded state dict
(global layer and expert numbers, the padded vocabulary's rows), with megatron-core's own init
functions for it (TransformerConfig: init_method, output_layer_init_method for the output
projections, embedding_init_method), and each rank keeps its slice (global offsets). Norms and
biases are constants megatron-core already set the same way at every layout.
"""

from __future__ import annotations

import zlib
from typing import Callable, Iterator

import torch

# The projections whose output adds to the residual stream: Megatron-LM's scaled init,
# N(0, std / sqrt(2 L)) (Shoeybi et al. 2019, "Megatron-LM", section 2.3).
_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")
_EMBEDDINGS = ("word_embeddings.weight", "position_embeddings.weight")


def draw_layout_free(chunks: list, seed: int) -> None:
    """Draw every weight matrix of this rank's chunks as the same seed draws it at any layout."""
    for chunk in chunks:
        config = chunk.config
        parameters = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
        for sharded in _sharded_tensors(chunk.sharded_state_dict()):
            data = sharded.data
            if data.dim() < 2 or data.untyped_storage().data_ptr() not in parameters:
                continue  # norms, biases and buffers: constants, or not weights
            with torch.no_grad():
                data.copy_(_slice_of_whole(sharded, _init_method(config, sharded.key), seed))


def _init_method(config, key: str) -> Callable[[torch.Tensor], object]:
    if key.endswith(_OUTPUT_PROJECTIONS):
        return config.output_layer_init_method
    if key.endswith(_EMBEDDINGS):
        return config.embedding_init_method or config.init_method
    return config.init_method


def _slice_of_whole(sharded, init_method, seed: int) -> torch.Tensor:
    """This rank's slice of the whole tensor `sharded` is a part of, drawn by `init_method` from a
    generator seeded by `seed` and the tensor's key. Axes megatron-core prepends (an expert's
    number) name separate tensors: each is drawn on its own, so a rank draws only its experts."""
    data, prepended = sharded.data, sharded.prepend_axis_num
    if getattr(sharded, "flattened_range", None) is not None:
        raise ValueError(f"{sharded.key}: a flattened shard (an optimizer's), not a model weight")
    name = f"{sharded.key}@{tuple(sharded.global_offset[:prepended])}"
    whole = torch.empty(sharded.global_shape[prepended:], dtype=torch.float32, device=data.device)
    on_gpu = data.device.type == "cuda"
    with torch.random.fork_rng(devices=[data.device] if on_gpu else []):
        # the generator init_method draws from: the tensor's device's default one
        generator = torch.cuda.default_generators[data.device.index] if on_gpu else torch.default_generator
        generator.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        init_method(whole)
    region = tuple(slice(offset, offset + size) for offset, size in zip(sharded.global_offset[prepended:], data.shape))
    return whole[region].to(data.dtype)


def _sharded_tensors(state: dict) -> Iterator:
    """The ShardedTensors of a sharded state dict, factories built into theirs (SwiGLU's fc1 is
    one factory of two tensors, views into the parameter)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for value in state.values():
        if isinstance(value, dict):
            yield from _sharded_tensors(value)
        elif isinstance(value, ShardedTensorFactory):
            built = value.build()
            yield from _sharded_tensors(built if isinstance(built, dict) else {str(i): t for i, t in enumerate(built)})
        elif isinstance(value, ShardedTensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _sharded_tensors({str(i): t for i, t in enumerate(value)})
