"""The resolved layout: every derived number of a configuration, computed in one place.

World size, data-parallel size, gradient accumulation, micro-batches per step, padded vocabulary,
training steps, the rescaled learning rate and warmup, and the pipeline bubble. The validator
checks a configuration; `resolve` turns a valid one into a `Layout` that the emitters, the
planner and the trainer all read, so nothing downstream recomputes these.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from toolkit.config.schema import Config
from toolkit.plan.backends import backend_of
from toolkit.plan.parallel_dims import ParallelDims


@dataclass(frozen=True)
class Layout:
    world_size: int
    dims: ParallelDims  # tp, pp, vpp, cp, dp (toolkit.plan.parallel_dims)
    micro_batch: int
    global_batch: int
    grad_accum: int  # micro-batches per optimizer step on each data-parallel rank
    seq_length: int
    padded_vocab_size: int
    stage_layers: tuple[int, ...]  # transformer layers on each pipeline stage
    steps: int  # the learning-rate schedule's length
    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    bubble_fraction: float
    loader_workers: int = 0  # DataLoader processes per rank (data.num_workers, or its default)
    stop_after_steps: int | None = None  # train.stop_after_steps

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def vpp(self) -> int:
        return self.dims.vpp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def gpu_tokens(self) -> int:
        """Tokens of one micro-batch on one GPU (context parallel splits each sequence)."""
        return self.micro_batch * self.seq_length // self.cp

    @property
    def last_step(self) -> int:
        """The step the run ends after: train.steps, or train.stop_after_steps when sooner."""
        return min(self.steps, self.stop_after_steps or self.steps)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches each pipeline processes per step (Megatron's num_microbatches)."""
        return self.grad_accum


@functools.lru_cache(maxsize=4096, typed=True)  # pure; the layout search asks for each split often
def stage_layer_counts(
    num_layers: int, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None
) -> tuple[int, ...] | None:
    """Layers on each pipeline stage, as megatron-core splits them (TransformerConfig "Uneven
    PP"): first/last stage counts when given, the rest evenly over the middle stages. Every
    stage's count must divide by vpp. None when the layers do not split so."""
    if pp == 1:
        counts = [num_layers] if first is None and last is None else []
    else:
        middle = pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        if (
            (first is not None and first < 1)
            or (last is not None and last < 1)
            or rest < 0
            or bool(middle) != bool(rest)
            or (middle and rest % middle)
        ):
            return None
        each = rest // middle if middle else 0
        counts = [first if first is not None else each] + [each] * (pp - 2) + [last if last is not None else each]
    if not counts or any(c % vpp or c == 0 for c in counts):
        return None
    return tuple(counts)


def world_size(cfg: Config) -> int:
    return cfg.cluster.nodes * cfg.cluster.gpus_per_node


def derived_dp(cfg: Config) -> int | None:
    """parallel.dp if given, else the world over the ranks one model replica spans (tp*pp*cp) when
    that divides; None when it does not."""
    if cfg.parallel.dp is not None:
        return cfg.parallel.dp
    model_parallel = ParallelDims.of(cfg.parallel, dp=1).model_parallel_size
    world = world_size(cfg)
    return world // model_parallel if world % model_parallel == 0 else None


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """The embedding's rows: the vocabulary rounded up to a multiple of divisible_by (GEMM-friendly
    shapes; divisible_by=0 disables padding). Megatron-LM rounds to divisible_by * tp
    (`_vocab_size_with_padding`), which makes the model, its padded rows taking part in the
    softmax, differ with tp; here the padding belongs to the model, the same at every layout, and
    the validator checks that tp divides it."""
    if divisible_by <= 0:
        return vocab_size
    return -(-vocab_size // divisible_by) * divisible_by


def lr_scale_factor(rule: str, global_batch: int, reference_batch: int | None) -> float:
    """How much the learning rate grows when the global batch grows from the reference batch.

    linear: lr * B/B_ref (Goyal et al. 2017, "Accurate, Large Minibatch SGD", section 2.1).
    sqrt:   lr * sqrt(B/B_ref) (Krizhevsky 2014, "One weird trick", section 5; Malladi et al.
            2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms", for Adam).
    """
    if rule == "none" or not reference_batch:
        return 1.0
    ratio = global_batch / reference_batch
    return ratio if rule == "linear" else math.sqrt(ratio)


def rescaled_warmup(warmup_steps: int, rule: str, global_batch: int, reference_batch: int | None) -> int:
    """Keep the warmup's number of samples fixed when the batch changes (Goyal et al. 2017,
    section 2.2, warm up over a fixed amount of data): steps scale by B_ref/B."""
    if rule == "none" or not reference_batch or warmup_steps == 0:
        return warmup_steps
    return max(1, round(warmup_steps * reference_batch / global_batch))


def training_steps(cfg: Config) -> int:
    """train.steps, or train.tokens / (global_batch * seq_length) rounded up."""
    if cfg.train.steps is not None:
        return cfg.train.steps
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_length
    return -(-(cfg.train.tokens or 0) // tokens_per_step)


def bubble_fraction(pp: int, vpp: int, num_microbatches: int) -> float:
    """Idle fraction of 1F1B / interleaved 1F1B: (p-1)/(v*m) of the ideal time
    (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
    Using Megatron-LM", sections 2.2.1-2.2.2)."""
    return (pp - 1) / (vpp * num_microbatches)


def loader_workers(cfg: Config) -> int:
    """data.num_workers, or by default 2 loader processes per rank on GPUs (Megatron-LM's
    --num-workers) and none on CPU, where the ranks already use every core."""
    if cfg.data.num_workers is not None:
        return cfg.data.num_workers
    return 2 if cfg.cluster.device == "cuda" else 0


def resolve(cfg: Config) -> Layout:
    """The derived numbers of a configuration the validator accepted: world size, dp, micro-batches
    per step, padded vocabulary, layers per pipeline stage, steps, scaled learning rate and warmup."""
    p, t, o = cfg.parallel, cfg.train, cfg.optim
    dp = derived_dp(cfg)
    grad_accum = t.global_batch // (t.micro_batch * dp)
    steps = training_steps(cfg)
    factor = lr_scale_factor(o.lr_scaling, t.global_batch, o.reference_global_batch)
    warmup = rescaled_warmup(o.warmup_steps, o.lr_scaling, t.global_batch, o.reference_global_batch)
    return Layout(
        world_size=world_size(cfg),
        dims=ParallelDims.of(p, dp=dp),
        micro_batch=t.micro_batch,
        global_batch=t.global_batch,
        grad_accum=grad_accum,
        seq_length=cfg.model.seq_length,
        padded_vocab_size=padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by)
        if backend_of(cfg).pads_vocab
        else cfg.model.vocab_size,
        stage_layers=stage_layer_counts(cfg.model.num_layers, p.pp, p.vpp, p.first_stage_layers, p.last_stage_layers),
        steps=steps,
        lr=o.lr * factor,
        min_lr=o.min_lr * factor,
        warmup_steps=warmup,
        decay_steps=o.decay_steps if o.decay_steps is not None else steps,
        bubble_fraction=bubble_fraction(p.pp, p.vpp, grad_accum),
        loader_workers=loader_workers(cfg),
        stop_after_steps=t.stop_after_steps,
    )
