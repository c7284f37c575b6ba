"""Compatibility layer that lets megatron-core run where CUDA and triton are absent.

Everything parakit needs to run megatron-core on CPU with gloo lives in this module; with CUDA
present `enable()` does nothing. megatron-core hard-codes CUDA in many places (device="cuda" and
torch.cuda.current_device() in DDP buffers, p2p buffers, attention masks, the RNG tracker,
streams), so instead of patching call sites one by one:
- a TorchFunctionMode maps CUDA devices to the CPU and makes .cuda()/.pin_memory() no-ops;
- torch.cuda's device, stream, synchronisation and RNG functions get CPU stand-ins;
- Tensor.type() reports "torch.cuda.*" where the optimizer checks for it;
- custom autograd functions' backward runs under the mode too (recompute starts a backward of its own).
The resume fixes for torch's Adam are not CPU matters: toolkit.train.torch_adam installs them
wherever megatron-core falls back to it.
Callers must also set use_cpu_initialization=True, pipeline_dtype, and batch_p2p_comm=False
(gloo pairs batched isend/irecv wrongly when the previous and next stage are one peer); the
emitter does that for cluster.device=cpu.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from toolkit.compat import import_shims

_CPU = torch.device("cpu")
_mode: TorchFunctionMode | None = None


def _to_cpu(device):
    is_cuda = (
        isinstance(device, int)
        and not isinstance(device, bool)
        or isinstance(device, str)
        and device.startswith("cuda")
        or isinstance(device, torch.device)
        and device.type == "cuda"
    )
    return _CPU if is_cuda else device


class _CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.is_pinned:
            return False
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)  # the optimizer compares with "torch.cuda.FloatTensor"
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


class _SynchronousStream:
    """torch.cuda.Stream / Event on the CPU, where everything is already synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "record_event":  # the MoE token dispatcher waits on the event it records
            return lambda *a, **k: _SynchronousStream()
        return lambda *a, **k: True if name == "query" else None


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0  # the mode maps device 0 to the CPU
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.current_stream = cuda.default_stream = lambda *a, **k: _SynchronousStream()
    cuda.Stream = cuda.Event = _SynchronousStream
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.get_rng_state = cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = cuda.random.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # torch.manual_seed calls torch.cuda.manual_seed_all: seed the default generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.memory_allocated = cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.nvtx.range_push = cuda.nvtx.range_pop = lambda *a, **k: None


def _import_megatron_without_compiling() -> None:
    from toolkit.train.eager_imports import import_without_compiling

    import_without_compiling("megatron.core")
    from megatron.core import jit

    jit.disable_jit_fuser()  # what later imports decorate runs eagerly too


def _fork_write_results_queue() -> None:
    """dist_checkpointing's writers report through a multiprocessing Manager queue that it starts
    on the first save from a *spawned* interpreter (CUDA-safe: no forked CUDA context), which
    re-imports this rank's modules: about 2 s per rank on that save, 5 s with 4 ranks on 2 cores.
    Without CUDA a forked manager is safe and starts at once (its process ends with the rank's
    other helpers, toolkit.train.distributed.end_helper_processes)."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()


def _split_sizes_on_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """moe_utils.maybe_move_tensor_to_cpu where tensors are already on the host: it turns the
    all-to-all's split sizes into numpy only when they come from a GPU, and gloo's
    all_to_all_single takes no tensor for them."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _uneven_collectives() -> None:
    """The MoE dispatcher's all-gather and reduce-scatter of unequal shares over the tensor-parallel
    ranks (tensor_parallel/mappings.py, with output/input split sizes) use torch.distributed's
    list forms, which gloo refuses for unequal sizes: run them as the equal collectives megatron-core
    uses otherwise, each share padded to the largest, and cut the padding off."""
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def padded(parts: list, rows: int) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, rows - t.shape[0])) for t in parts])

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        rows = max(output_split_sizes)
        gathered = gather(padded([input_], rows), group)
        parts = gathered.split(rows)
        return torch.cat([part[:size] for part, size in zip(parts, output_split_sizes)])

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        rows = max(input_split_sizes)
        reduced = reduce_scatter(padded(list(input_.split(input_split_sizes)), rows), group)
        return reduced[: input_split_sizes[group.rank()]]

    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = reduce_scatter_uneven


def _l2_norm_in_float64(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron-core's gradient norm without apex (utils.local_multi_tensor_l2_norm): torch.norm
    of each gradient, which on CPU accumulates a tensor's squares in float32. Over the 3.2M
    elements of a 50,304 x 64 output layer that was 8.7e-5 off the float64 norm (5.0e-5 at tp=2,
    each rank half of it; measured on the corpus), more than the layouts differ. Accumulated in
    float64 here; the same result type ([1] float32) for clip_grads."""
    norms = [torch.linalg.vector_norm(t, dtype=torch.float64) for tensors in tensor_lists for t in tensors]
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), dtype=torch.float64)
    return total.float().reshape(1), None


def _patch_megatron() -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    megatron_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_on_host
    _uneven_collectives()
    _fork_write_results_queue()
    clip_grads.l2_norm_impl = _l2_norm_in_float64


def _backward_on_cpu() -> None:
    """Keep the mode on inside custom autograd functions' backward. torch.autograd.backward
    dispatches __torch_function__ (torch 2.13, torch/autograd/__init__.py), so a backward started
    by one (recompute's CheckpointFunction, which calls it inside the outer backward) runs while
    the mode is off the stack; megatron-core's backward functions then allocate on
    torch.cuda.current_device() (tensor_parallel/mappings.py) and fail without a GPU."""
    from torch.autograd.function import BackwardCFunction

    apply = BackwardCFunction.apply

    def apply_on_cpu(self, *args):
        with _CudaOnCpu():
            return apply(self, *args)

    BackwardCFunction.apply = apply_on_cpu


def enable() -> None:
    """Run megatron-core on the CPU from here on (no-op when CUDA is available)."""
    global _mode
    import_shims()
    if torch.cuda.is_available() or _mode is not None:
        return
    _patch_torch_cuda()
    _import_megatron_without_compiling()
    _patch_megatron()
    _backward_on_cpu()
    _mode = _CudaOnCpu()
    _mode.__enter__()
