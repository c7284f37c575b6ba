"""The layout validator: every rule a configuration must pass before a GPU-hour is spent.

Pure Python. `validate(cfg)` returns all errors and warnings at once; each names the fields,
their values, the rule, and a concrete fix. Errors are what DeepSpeed or Megatron would reject
(often only after a few steps); warnings are valid layouts that run slowly or train differently.
`check(cfg)` raises `ValidationError` when there are errors and returns the resolved `Layout`.

Sources for the rules: Megatron-LM `megatron/training/arguments.py::validate_args`, megatron-core
`TransformerConfig.__post_init__` and schedules, DeepSpeed `runtime/config.py` and
`runtime/pipe/engine.py`; the batch, learning-rate and warmup checks after the global batch
changes follow Goyal et al. 2017, "Accurate, Large Minibatch SGD", sections 2.1-2.2.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, Iterator

from toolkit.config.schema import TOKENIZER_VOCAB, Config, DataName
from toolkit.families import hf_config
from toolkit.formats import hf_arch, hf_files
from toolkit.formats.manifest import manifest_path, parse_blend, read_manifest
from toolkit.plan.backends import Package, backend_of, packages_needed, supporting
from toolkit.plan.fit import memory_problem
from toolkit.plan.layout import (
    Layout,
    bubble_fraction,
    derived_dp,
    padded_vocab_size,
    resolve,
    stage_layer_counts,
    world_size,
)

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class Violation:
    rule: str  # short id, e.g. "pp_layers"
    severity: str  # error | warning
    fields: dict  # field path -> value, the values that break the rule
    message: str  # what is wrong
    fix: str  # a concrete change that satisfies the rule

    def __str__(self) -> str:
        values = ", ".join(f"{k}={v.value if isinstance(v, Enum) else v!r}" for k, v in self.fields.items())
        return f"{self.severity} [{self.rule}] {values}: {self.message}. Fix: {self.fix}"


@dataclass(frozen=True)
class Report:
    errors: tuple[Violation, ...]
    warnings: tuple[Violation, ...]
    packages: tuple[Package, ...] = ()  # what the options need on the machines that train

    @property
    def ok(self) -> bool:
        return not self.errors

    def needs(self) -> str:
        """One line naming the packages the machines that train need, or "" when none."""
        if not self.packages:
            return ""
        listing = "; ".join(f"{p.install} ({p.field}={p.value}: {p.why})" for p in self.packages)
        return f"needs on the machines that train: {listing}"

    def __str__(self) -> str:
        lines = [str(v) for v in self.errors + self.warnings] + [self.needs()] * bool(self.packages)
        return "\n".join(lines) if lines else "ok: no errors, no warnings"


class ValidationError(ValueError):
    """Raised by `check` with every error of the configuration."""

    def __init__(self, report: Report):
        self.report = report
        count = len(report.errors)
        super().__init__(f"{count} configuration error{'s' * (count != 1)}:\n" + "\n".join(map(str, report.errors)))


def _err(rule, fields, message, fix):
    return Violation(rule, ERROR, fields, message, fix)


def _warn(rule, fields, message, fix):
    return Violation(rule, WARNING, fields, message, fix)


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def _listing(values) -> str:
    values = list(values)
    if len(values) > 12:
        values = values[:6] + ["..."] + values[-3:]
    return ", ".join(str(v) for v in values)


# ---------------------------------------------------------------- value ranges
# Closed sets of values (dtype, recompute, backend, ...) are enums in toolkit.config.schema:
# composition refuses any other value and names the allowed ones.
_AT_LEAST_ONE = (
    "train.stop_after_steps",
    "train.eval_interval",
    "train.eval_iters",
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.num_kv_heads",
    "model.head_dim",
    "model.ffn_hidden_size",
    "model.vocab_size",
    "model.seq_length",
    "model.max_position_embeddings",
    "parallel.tp",
    "parallel.pp",
    "parallel.vpp",
    "parallel.dp",
    "parallel.cp",
    "parallel.first_stage_layers",
    "parallel.last_stage_layers",
    "train.global_batch",
    "train.micro_batch",
    "train.grad_accum",
    "train.steps",
    "train.tokens",
    "train.log_interval",
    "cluster.nodes",
    "cluster.gpus_per_node",
    "cluster.sm_count",
    "checkpoint.interval_steps",
    "checkpoint.keep_last",
)
_NON_NEGATIVE = (
    "data.num_workers",
    "model.make_vocab_size_divisible_by",
    "model.norm_epsilon",
    "model.init_method_std",
    "optim.lr",
    "optim.min_lr",
    "optim.eps",
    "optim.weight_decay",
    "optim.clip_grad",
    "optim.warmup_steps",
    "optim.decay_steps",
    "optim.reference_global_batch",
    "precision.loss_scale",
    "precision.min_loss_scale",
    "precision.loss_scale_window",
    "precision.hysteresis",
    "recompute.num_layers",
    "cluster.gpu_memory_gb",
)
_POSITIVE = ("checkpoint.interval_minutes",)


def _get(cfg: Config, path: str):
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _floats(section, prefix: str = "") -> Iterator[tuple[str, float, object]]:
    """(path, value, default) of every float field of a configuration, nested sections included."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from _floats(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            yield f"{prefix}{f.name}", value, f.default


def _non_finite(cfg: Config) -> Iterator[Violation]:
    """nan and inf compare false with every bound, so the range rules would let them through."""
    for path, value, default in _floats(cfg):
        if not math.isfinite(value):
            example = ", or null to turn it off" if default is None else f", e.g. {default:g}"
            yield _err("finite", {path: value}, "must be a finite number", f"set {path} to a finite number{example}")


def _ranges(cfg: Config) -> Iterator[Violation]:
    yield from _non_finite(cfg)
    for path in _AT_LEAST_ONE:
        value = _get(cfg, path)
        if value is not None and value < 1:
            yield _err("range", {path: value}, "must be a positive integer", f"set {path} >= 1")
    for path in _NON_NEGATIVE:
        value = _get(cfg, path)
        if value is not None and value < 0 and math.isfinite(value):
            yield _err("range", {path: value}, "must not be negative", f"set {path} >= 0")
    for path in _POSITIVE:
        value = _get(cfg, path)
        if value is not None and value <= 0:
            yield _err("range", {path: value}, "must be positive (null turns it off)", f"set {path} > 0, or null")
    if cfg.zero.stage not in (0, 1, 2, 3):
        yield _err("choice", {"zero.stage": cfg.zero.stage}, "ZeRO has stages 0-3", "use zero=0, 1, 2 or 3")
    dropouts = ("model.hidden_dropout", "model.attention_dropout")
    bad_dropout = [p for p in dropouts if math.isfinite(_get(cfg, p)) and not 0 <= _get(cfg, p) < 1]
    if bad_dropout:
        yield _err("range", {p: _get(cfg, p) for p in bad_dropout}, "a dropout rate lies in [0, 1)", "use 0.0 to 0.1")
    if cfg.train.steps is None and cfg.train.tokens is None:
        yield _err(
            "train_length",
            {"train.steps": None, "train.tokens": None},
            "the run has no length",
            "set train.steps=N or train.tokens=N",
        )
    for path in ("optim.beta1", "optim.beta2"):
        if math.isfinite(_get(cfg, path)) and not 0 <= _get(cfg, path) < 1:
            yield _err(
                "range",
                {path: _get(cfg, path)},
                "an Adam beta lies in [0, 1)",
                f"set {path}=0.9 (beta1) or 0.95 (beta2)",
            )


# ---------------------------------------------------------------- the model itself
def _model(cfg: Config) -> Iterator[Violation]:
    m = cfg.model
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        yield _err(
            "head_dim",
            {"model.hidden_size": m.hidden_size, "model.num_attention_heads": m.num_attention_heads},
            "hidden size is not divisible by the number of heads",
            f"use heads in {{{_listing(_divisors(m.hidden_size))}}} or set model.head_dim",
        )
    kv = m.num_kv_heads or m.num_attention_heads
    if m.num_attention_heads % kv:
        yield _err(
            "kv_heads",
            {"model.num_attention_heads": m.num_attention_heads, "model.num_kv_heads": kv},
            "each KV head must serve the same number of query heads (GQA groups)",
            f"use model.num_kv_heads in {{{_listing(_divisors(m.num_attention_heads))}}}",
        )
    if m.seq_length > m.max_position_embeddings:
        yield _err(
            "seq_length",
            {"model.seq_length": m.seq_length, "model.max_position_embeddings": m.max_position_embeddings},
            "training sequences are longer than the model supports",
            f"set model.seq_length<={m.max_position_embeddings} (or raise max_position_embeddings for a new model)",
        )
    yield from _hf_path(cfg)
    yield from _hf_weights(cfg)
    yield from _init_checkpoint(cfg)


def _init_checkpoint(cfg: Config) -> Iterator[Violation]:
    """train.init_checkpoint is a megatron-core dist checkpoint: its metadata.json is there
    (megatron/core/dist_checkpointing/core.py, check_is_distributed_checkpoint), checked before any
    rank starts instead of on every rank."""
    path = cfg.train.init_checkpoint
    if path and not (Path(path) / "metadata.json").is_file():
        what = (
            "no megatron-core dist checkpoint there (no metadata.json)" if Path(path).is_dir() else "no such directory"
        )
        yield _err(
            "init_checkpoint",
            {"train.init_checkpoint": path},
            what,
            "point it at a directory train.save_init_checkpoint wrote, or convert Hugging Face weights: "
            "parakit convert hf-to-megatron HF_DIR --output DIR",
        )


def _hf_path(cfg: Config) -> Iterator[Violation]:
    """The weights of model.hf_path fit the configured model (its config.json, read as json)."""
    m = cfg.model
    if not m.hf_path:
        return
    try:
        diff = hf_config.mismatches(m, m.hf_path)
    except hf_arch.HfConfigError as e:
        what, _, fix = str(e).partition("; ")
        yield _err("hf_path", {"model.hf_path": m.hf_path}, what.removeprefix(f"model.hf_path={m.hf_path}: "), fix)
        return
    if diff:
        yield _err(
            "hf_path_architecture",
            {"model.hf_path": m.hf_path, **{f"model.{name}": ours for name, (ours, _) in diff.items()}},
            f"its config.json describes another model (configured vs config.json): {hf_config.describe(diff)}",
            hf_config.MISMATCH_FIX.format(path=m.hf_path),
        )


def _hf_weights(cfg: Config) -> Iterator[Violation]:
    """The weight files every rank opens in model.hf_path are there (toolkit.formats.hf_files: the
    list HfTensors reads, and the names transformers' from_pretrained looks for), unless
    train.init_checkpoint replaces them (megatron_backend's setup loads one or the other)."""
    m, formats = cfg.model, backend_of(cfg).hf_weights
    if not m.hf_path or cfg.train.init_checkpoint or not formats or not Path(m.hf_path).expanduser().is_dir():
        return  # no such directory: _hf_path says so
    try:
        hf_files.weight_files(m.hf_path, formats)
    except hf_arch.HfConfigError as e:
        what, _, fix = str(e).partition("; ")
        yield _err("hf_weights", {"model.hf_path": m.hf_path}, what.removeprefix(f"model.hf_path={m.hf_path}: "), fix)


def _rope(cfg: Config) -> Iterator[Violation]:
    """llama3 RoPE scaling's parameters (transformers `_validate_llama3_rope_parameters` warns about the
    same bounds; here they are errors, since a run with them trains a different model than intended)."""
    m, rs = cfg.model, cfg.model.rope_scaling
    if rs.type == "none":
        return
    if m.position_embedding != "rope":
        yield _err(
            "rope_scaling_position",
            {"model.rope_scaling.type": rs.type, "model.position_embedding": m.position_embedding},
            "RoPE scaling stretches rotary position embeddings, which this model does not use",
            "set model.rope_scaling.type=none, or model.position_embedding=rope",
        )
    if rs.factor < 1:
        yield _err(
            "rope_scaling",
            {"model.rope_scaling.factor": rs.factor},
            "llama3 scaling slows the low frequencies down by the factor, which must be >= 1",
            "set model.rope_scaling.factor>=1 (8 for Llama 3.1, 32 for Llama 3.2 1B)",
        )
    if not 0 < rs.low_freq_factor < rs.high_freq_factor:
        yield _err(
            "rope_scaling",
            {
                "model.rope_scaling.low_freq_factor": rs.low_freq_factor,
                "model.rope_scaling.high_freq_factor": rs.high_freq_factor,
            },
            "the interpolated band lies between wavelengths L/high_freq_factor and L/low_freq_factor: "
            "it needs 0 < low_freq_factor < high_freq_factor",
            "set model.rope_scaling.low_freq_factor=1.0 and model.rope_scaling.high_freq_factor=4.0 (Llama 3.1)",
        )
    if not 0 < rs.original_max_position_embeddings < m.max_position_embeddings:
        yield _err(
            "rope_scaling_context",
            {
                "model.rope_scaling.original_max_position_embeddings": rs.original_max_position_embeddings,
                "model.max_position_embeddings": m.max_position_embeddings,
            },
            "scaling extends the pretraining context (original_max_position_embeddings) to a longer "
            "max_position_embeddings",
            "set model.rope_scaling.original_max_position_embeddings to the context the model was pretrained at "
            f"(below {m.max_position_embeddings}; 8192 for Llama 3.1), or model.rope_scaling.type=none",
        )


# ---------------------------------------------------------------- parallel layout
def _parallel(cfg: Config) -> Iterator[Violation]:
    m, p, c = cfg.model, cfg.parallel, cfg.cluster
    world = world_size(cfg)
    model_parallel = p.tp * p.pp * p.cp
    fields = {
        "parallel.tp": p.tp,
        "parallel.pp": p.pp,
        "parallel.cp": p.cp,
        "cluster.nodes": c.nodes,
        "cluster.gpus_per_node": c.gpus_per_node,
    }
    if p.dp is not None and p.dp * model_parallel != world:
        fits = f"parallel.dp={world // model_parallel}" if world % model_parallel == 0 else "leave parallel.dp out"
        yield _err(
            "world_size",
            {**fields, "parallel.dp": p.dp},
            f"dp*tp*pp*cp = {p.dp * model_parallel} but the cluster has {world} devices",
            f"set {fits}, or size the cluster to {p.dp * model_parallel} devices",
        )
    elif world % model_parallel:
        yield _err(
            "world_size",
            fields,
            f"tp*pp*cp = {model_parallel} does not divide the {world} devices",
            f"use tp*pp*cp in {{{_listing(_divisors(world))}}}, or a cluster of a multiple of {model_parallel} devices",
        )

    kv = m.num_kv_heads or m.num_attention_heads
    # megatron-core TransformerConfig: heads % tp == 0, and KV heads either split evenly
    # (kv % tp == 0) or are replicated evenly (tp % kv == 0).
    if m.num_attention_heads % p.tp or (kv % p.tp and p.tp % kv):
        good = [d for d in _divisors(m.num_attention_heads) if kv % d == 0 or d % kv == 0]
        yield _err(
            "tp_heads",
            {"parallel.tp": p.tp, "model.num_attention_heads": m.num_attention_heads, "model.num_kv_heads": kv},
            "each tensor-parallel rank must hold whole attention heads, and KV heads must split or replicate evenly",
            f"use parallel.tp in {{{_listing(good)}}}",
        )
    if m.ffn_hidden_size % p.tp:
        yield _err(
            "tp_ffn",
            {"parallel.tp": p.tp, "model.ffn_hidden_size": m.ffn_hidden_size},
            "the MLP's columns do not split evenly across tensor-parallel ranks",
            f"use parallel.tp in {{{_listing(_divisors(m.ffn_hidden_size, 64))}}}",
        )
    if m.make_vocab_size_divisible_by == 0 and m.vocab_size % p.tp:
        yield _err(
            "vocab_tp",
            {"model.vocab_size": m.vocab_size, "parallel.tp": p.tp, "model.make_vocab_size_divisible_by": 0},
            "vocabulary padding is off and the embedding rows do not split evenly across tensor-parallel ranks",
            f"set model.make_vocab_size_divisible_by=128 (pads to {padded_vocab_size(m.vocab_size, 128, p.tp)})",
        )
    if p.tp > c.gpus_per_node:
        yield _err(
            "tp_in_node",
            {"parallel.tp": p.tp, "cluster.gpus_per_node": c.gpus_per_node},
            "tensor parallel communicates in every layer and must stay inside a node",
            f"use parallel.tp<={c.gpus_per_node} and add pipeline stages (parallel.pp) across nodes",
        )
    if p.sequence_parallel and p.tp == 1:
        yield _err(
            "sp_needs_tp",
            {"parallel.sequence_parallel": True, "parallel.tp": 1},
            "sequence parallel splits the tensor-parallel region's activations and needs tp > 1",
            "set parallel.sequence_parallel=false, or parallel.tp>=2",
        )
    if p.tp_comm_overlap and not p.sequence_parallel:
        yield _err(
            "tp_overlap_needs_sp",
            {"parallel.tp_comm_overlap": True, "parallel.sequence_parallel": False},
            "megatron-core overlaps the all-gathers and reduce-scatters of sequence parallel with the GEMMs; "
            "without it there is nothing to overlap (Megatron-LM asserts the same)",
            "set parallel.sequence_parallel=true (with parallel.tp>=2), or parallel.tp_comm_overlap=false",
        )
    if p.tp_comm_overlap and c.device != "cuda":
        yield _err(
            "tp_overlap_device",
            {"parallel.tp_comm_overlap": True, "cluster.device": c.device},
            "the overlap runs in Transformer Engine's userbuffers, on CUDA devices only",
            "set parallel.tp_comm_overlap=false",
        )
    if p.sequence_parallel and m.seq_length % p.tp:
        yield _err(
            "sp_seq",
            {"parallel.sequence_parallel": True, "model.seq_length": m.seq_length, "parallel.tp": p.tp},
            "sequence parallel needs the sequence length divisible by tp",
            f"use model.seq_length={m.seq_length - m.seq_length % p.tp or p.tp}",
        )
    if p.cp > 1 and m.seq_length % (2 * p.cp):
        yield _err(
            "cp_seq",
            {"parallel.cp": p.cp, "model.seq_length": m.seq_length},
            "context parallel splits each sequence into 2*cp load-balanced chunks",
            f"use a model.seq_length divisible by {2 * p.cp}",
        )

    uneven = p.first_stage_layers is not None or p.last_stage_layers is not None
    if uneven and p.pp == 1:
        yield _err(
            "pp_uneven",
            {
                "parallel.pp": 1,
                "parallel.first_stage_layers": p.first_stage_layers,
                "parallel.last_stage_layers": p.last_stage_layers,
            },
            "first/last stage layer counts need pipeline stages",
            "leave them out, or set parallel.pp>=2",
        )
    elif uneven and stage_layer_counts(m.num_layers, p.pp, p.vpp, p.first_stage_layers, p.last_stage_layers) is None:
        first, last = p.first_stage_layers or 0, p.last_stage_layers or 0
        middle = p.pp - (p.first_stage_layers is not None) - (p.last_stage_layers is not None)
        yield _err(
            "pp_uneven",
            {
                "parallel.pp": p.pp,
                "parallel.vpp": p.vpp,
                "parallel.first_stage_layers": p.first_stage_layers,
                "parallel.last_stage_layers": p.last_stage_layers,
                "model.num_layers": m.num_layers,
            },
            f"the {m.num_layers - first - last} remaining layers must split evenly over {middle} middle stage(s), "
            "and every stage's layers must divide by vpp",
            _uneven_fix(m.num_layers, p.pp, p.vpp),
        )
    elif not uneven and m.num_layers % (p.pp * p.vpp):
        stages = p.pp * p.vpp
        pps = [d for d in _divisors(m.num_layers) if d * p.vpp <= m.num_layers and m.num_layers % (d * p.vpp) == 0]
        fix = f"use parallel.pp in {{{_listing(pps)}}}" if pps else "use parallel.vpp=1"
        if p.vpp > 1 and m.num_layers % p.pp == 0:
            fix += f", or parallel.vpp in {{{_listing(_divisors(m.num_layers // p.pp))}}}"
        if p.pp > 2 and "parallel.first_stage_layers" in _uneven_fix(m.num_layers, p.pp, p.vpp):
            fix += f", or an uneven split: {_uneven_fix(m.num_layers, p.pp, p.vpp)}"
        yield _err(
            "pp_layers",
            {"parallel.pp": p.pp, "parallel.vpp": p.vpp, "model.num_layers": m.num_layers},
            f"{m.num_layers} layers do not split into pp*vpp = {stages} equal model chunks",
            fix,
        )
    if p.vpp > 1 and p.pp == 1:
        yield _err(
            "vpp_needs_pp",
            {"parallel.vpp": p.vpp, "parallel.pp": 1},
            "the interleaved schedule interleaves pipeline stages and needs pp > 1",
            "set parallel.vpp=1, or parallel.pp>=2",
        )


def _uneven_fix(num_layers: int, pp: int, vpp: int) -> str:
    """An uneven split with fewer layers on the first and last stage, when one exists."""
    per_stage = -(-num_layers // pp)
    per_stage += (-per_stage) % vpp
    edge2 = num_layers - (pp - 2) * per_stage
    if pp > 2 and edge2 > 0 and edge2 % 2 == 0 and (edge2 // 2) % vpp == 0:
        return f"set parallel.first_stage_layers={edge2 // 2} parallel.last_stage_layers={edge2 // 2}"
    return "choose counts so that the middle stages get equal layers, each divisible by vpp"


# ---------------------------------------------------------------- batch split
def _batch(cfg: Config) -> Iterator[Violation]:
    t, p = cfg.train, cfg.parallel
    dp = derived_dp(cfg)
    if dp is None or dp < 1:
        return  # reported by the world_size rule
    per_step = t.micro_batch * dp
    fields = {"train.global_batch": t.global_batch, "train.micro_batch": t.micro_batch, "parallel.dp": dp}
    if t.global_batch % per_step:
        lower = max(per_step, t.global_batch - t.global_batch % per_step)
        micro = [d for d in _divisors(t.global_batch // dp) if d <= 64] if t.global_batch % dp == 0 else []
        fix = f"use train.global_batch={lower} or {lower + per_step} (a multiple of micro_batch*dp = {per_step})"
        if micro:
            fix += f", or train.micro_batch in {{{_listing(micro)}}}"
        yield _err("batch_split", fields, "global batch != micro_batch * dp * grad_accum for any whole grad_accum", fix)
        return
    accum = t.global_batch // per_step
    if t.grad_accum is not None and t.grad_accum != accum:
        yield _err(
            "grad_accum",
            {**fields, "train.grad_accum": t.grad_accum},
            f"global_batch / (micro_batch * dp) = {accum} accumulation steps",
            f"set train.grad_accum={accum} or leave it out, or train.global_batch={t.grad_accum * per_step}",
        )
    if p.vpp > 1 and p.pp > 1 and accum % p.pp:
        step = per_step * p.pp
        yield _err(
            "vpp_microbatches",
            {**fields, "parallel.pp": p.pp, "parallel.vpp": p.vpp},
            f"the interleaved schedule needs the {accum} micro-batches per step to be a multiple of pp={p.pp}",
            f"use train.global_batch={max(step, t.global_batch - t.global_batch % step)} or "
            f"{t.global_batch - t.global_batch % step + step}",
        )


# ---------------------------------------------------------------- backend-specific support
def _others(feature) -> str:
    """`backend=NAME` for the backends that have `feature` (a fix's alternative)."""
    return " or ".join(f"backend={name}" for name in supporting(feature))


def _backend(cfg: Config) -> Iterator[Violation]:
    """What the configured backend cannot run, read from its description (toolkit.plan.backends)."""
    z, p, r, m = cfg.zero, cfg.parallel, cfg.recompute, cfg.model
    be = backend_of(cfg)
    b = be.name
    if p.pp > 1 and z.stage in be.zero_stages and z.stage not in be.pipeline_zero_stages:
        yield _err(
            "zero_pipeline",
            {"zero.stage": z.stage, "parallel.pp": p.pp, "backend.name": b},
            f"the {b} backend's pipeline engine supports ZeRO stage {_listing(be.pipeline_zero_stages)} only",
            f"use zero={max(be.pipeline_zero_stages)} with pipeline parallel, or parallel.pp=1 with ZeRO-{z.stage}",
        )
    in_use = {  # model-parallel dimension -> (field, value), for those this layout uses
        dim: (field, value)
        for dim, field, value, used in (
            ("tp", "parallel.tp", p.tp, p.tp > 1),
            ("pp", "parallel.pp", p.pp, p.pp > 1),
            ("vpp", "parallel.vpp", p.vpp, p.vpp > 1),
            ("cp", "parallel.cp", p.cp, p.cp > 1),
            ("sp", "parallel.sequence_parallel", True, p.sequence_parallel),
            ("tp_overlap", "parallel.tp_comm_overlap", True, p.tp_comm_overlap),
        )
        if used
    }
    unsupported = {field: value for dim, (field, value) in in_use.items() if dim not in be.parallel_dims}
    if unsupported:
        yield _err(
            f"{b}_layout",
            {**unsupported, "backend.name": b},
            f"the {b} backend trains with data parallel, ZeRO and "
            f"{', '.join(sorted(be.parallel_dims)) or 'no model'} parallelism only",
            f"use {_others(lambda o: set(in_use) <= o.parallel_dims)} for {', '.join(unsupported)}",
        )
    if p.pp > 1 and m.sliding_window and not be.pipeline_sliding_window:
        yield _err(
            "pipeline_sliding_window",
            {"parallel.pp": p.pp, "model.sliding_window": m.sliding_window},
            f"the {b} pipeline stages run decoder layers without the model's sliding-window mask",
            f"use parallel.pp=1 on the {b} backend, or {_others(lambda o: o.pipeline_sliding_window)}",
        )
    if p.pp > 1 and m.tie_embeddings and not be.pipeline_tied_embeddings:
        yield _err(
            "pipeline_tied_embeddings",
            {"parallel.pp": p.pp, "model.tie_embeddings": True, "backend.name": b},
            f"the {b} pipeline keeps the input embedding and the output head on different stages",
            f"use parallel.pp=1, model.tie_embeddings=false, or {_others(lambda o: o.pipeline_tied_embeddings)}",
        )
    if (p.first_stage_layers is not None or p.last_stage_layers is not None) and not be.uneven_pipeline_stages:
        yield _err(
            "uneven_pipeline_backend",
            {
                "parallel.first_stage_layers": p.first_stage_layers,
                "parallel.last_stage_layers": p.last_stage_layers,
                "backend.name": b,
            },
            f"the {b} pipeline balances the decoder layers over its stages itself",
            "set parallel.first_stage_layers=null and parallel.last_stage_layers=null, or "
            f"{_others(lambda o: o.uneven_pipeline_stages)}",
        )
    if cfg.precision.dtype not in be.precisions:
        yield _err(
            f"{cfg.precision.dtype}_backend",
            {"precision.dtype": cfg.precision.dtype, "backend.name": b},
            f"the {b} backend trains in {_listing(be.precisions)}",
            f"use precision=bf16 or {_others(lambda o: cfg.precision.dtype in o.precisions)}",
        )
    if (
        be.nan_skip_needs_overflow_check
        and cfg.train.fault.nan_action == "skip"
        and z.stage == 0
        and cfg.precision.dtype == "fp32"
    ):
        # DeepSpeed drops an update with non-finite gradients only in its fp16/bf16 and ZeRO optimizers.
        yield _err(
            "nan_action_backend",
            {"train.fault.nan_action": "skip", "zero.stage": 0, "precision.dtype": "fp32", "backend.name": b},
            f"the {b} backend's plain fp32 optimizer applies an update even when its gradients are NaN",
            "use zero=1 (or higher), precision=bf16, train.fault.nan_action=stop, or "
            f"{_others(lambda o: not o.nan_skip_needs_overflow_check)}",
        )
    if r.granularity not in be.recompute:
        yield _err(
            "recompute_backend",
            {"recompute.granularity": r.granularity, "backend.name": b},
            f"the {b} backend recomputes {_listing(be.recompute)} only",
            f"use recompute=full or {_others(lambda o: r.granularity in o.recompute)}",
        )
    fixed = {k: v for k, v in be.rope_scaling_fixed if getattr(m.rope_scaling, k) != v}
    if m.rope_scaling.type != "none" and fixed:
        yield _err(
            "rope_scaling_backend",
            {**{f"model.rope_scaling.{k}": getattr(m.rope_scaling, k) for k in fixed}, "backend.name": b},
            f"the {b} backend sets only the llama3 scaling factor; it applies "
            + ", ".join(f"{k}={v:g}" for k, v in be.rope_scaling_fixed),
            "set "
            + " and ".join(f"model.rope_scaling.{k}={v:g}" for k, v in fixed.items())
            + f", or {_others(lambda o: not o.rope_scaling_fixed)}",
        )
    if (
        be.megatron_lm_entry
        and m.position_embedding == "rope"
        and math.isfinite(m.rotary_base)
        and m.rotary_base != int(m.rotary_base)
    ):
        # megatron_args.txt must say what megatron.yaml says, and Megatron-LM parses --rotary-base as int.
        yield _err(
            "rotary_base_integer",
            {"model.rotary_base": m.rotary_base, "backend.name": b},
            f"the {b} backend's Megatron-LM command line takes an integer RoPE base (--rotary-base)",
            f"set model.rotary_base={round(m.rotary_base)}, or {_others(lambda o: not o.megatron_lm_entry)}",
        )
    if m.hf_path and not be.hf_weights:
        yield _err(
            "hf_path_backend",
            {"model.hf_path": m.hf_path, "backend.name": b},
            f"Hugging Face weights load on the {_others(lambda o: o.hf_weights)} backend",
            f"use {_others(lambda o: o.hf_weights)}, or convert them (parakit convert hf-to-megatron) and set "
            "train.init_checkpoint",
        )
    init_weights = {f"train.{k}": getattr(cfg.train, k) for k in ("init_checkpoint", "save_init_checkpoint")}
    if any(init_weights.values()) and not be.dist_init_weights:
        yield _err(
            "init_weights_backend",
            {**{k: v for k, v in init_weights.items() if v}, "backend.name": b},
            f"the {b} backend would ignore it: initial weights as a megatron-core dist checkpoint are loaded and "
            f"saved by the {' and '.join(supporting(lambda o: o.dist_init_weights))} backend",
            f"use {_others(lambda o: o.dist_init_weights)}, or start {b} from Hugging Face weights (model.hf_path; "
            "python -m toolkit.interop.megatron_to_hf converts such a checkpoint)",
        )
    if z.stage not in be.zero_stages:
        yield _err(
            f"zero_{b}",
            {"zero.stage": z.stage, "backend.name": b},
            f"the {b} backend runs ZeRO stage {_listing(be.zero_stages)} ({be.zero_meaning})",
            f"use zero={max(be.zero_stages)} on {b}, or {_others(lambda o: z.stage in o.zero_stages)} for "
            f"ZeRO-{z.stage}",
        )
    if (z.offload_optimizer != "none" or z.offload_param != "none") and not be.offload:
        yield _err(
            "offload_backend",
            {"zero.offload_optimizer": z.offload_optimizer, "zero.offload_param": z.offload_param, "backend.name": b},
            "offload is a DeepSpeed ZeRO feature here",
            f"use {_others(lambda o: o.offload)}, or zero.offload_*=none",
        )
    if z.offload_optimizer != "none" and z.stage == 0:
        yield _err(
            "offload_stage",
            {"zero.offload_optimizer": z.offload_optimizer, "zero.stage": 0},
            "optimizer offload partitions optimizer states and needs ZeRO >= 1",
            "use zero=2_offload, or zero.stage>=1",
        )
    if z.offload_param != "none" and z.stage != 3:
        yield _err(
            "offload_stage",
            {"zero.offload_param": z.offload_param, "zero.stage": z.stage},
            "parameter offload needs ZeRO-3 (parameters partitioned)",
            "use zero=3_offload, or zero.offload_param=none",
        )
    if "nvme" in (z.offload_optimizer, z.offload_param) and not z.nvme_path:
        yield _err(
            "offload_nvme",
            {"zero.nvme_path": z.nvme_path},
            "NVMe offload needs a local NVMe folder",
            "set zero.nvme_path=/local_nvme/ds_offload",
        )


# ---------------------------------------------------------------- precision and hardware
def _precision(cfg: Config) -> Iterator[Violation]:
    dtype, c, pr = cfg.precision.dtype, cfg.cluster, cfg.precision
    if dtype == "fp16" and pr.loss_scaling == "none":
        yield _err(
            "fp16_loss_scale",
            {"precision.dtype": "fp16", "precision.loss_scaling": "none"},
            "fp16 gradients underflow without loss scaling (Micikevicius et al. 2018)",
            "set precision.loss_scaling=dynamic, or precision=bf16",
        )
    if dtype == "fp16" and c.device == "cpu":
        yield _err(
            "fp16_cpu",
            {"precision.dtype": "fp16", "cluster.device": "cpu"},
            "fp16 training is not supported on CPU (DeepSpeed refuses it, torch lacks fast fp16 GEMMs)",
            "use precision=bf16 or precision=fp32 on CPU",
        )
    peak = {"bf16": c.peak_tflops_bf16, "fp8": c.peak_tflops_fp8, "fp16": c.peak_tflops_fp16}.get(dtype)
    if peak is not None and peak <= 0 and not (dtype == "fp16" and c.device == "cpu"):
        alternative = (
            "precision=fp16"
            if dtype == "bf16" and c.peak_tflops_fp16 > 0
            else "precision=bf16"
            if c.peak_tflops_bf16 > 0
            else "precision=fp32"
        )
        yield _err(
            "dtype_hardware",
            {"precision.dtype": dtype, "cluster.gpu": c.gpu, f"cluster.peak_tflops_{dtype}": peak},
            f"this hardware has no {dtype} support",
            f"use {alternative}",
        )


# ---------------------------------------------------------------- recompute and optimizer
def _recompute(cfg: Config) -> Iterator[Violation]:
    r, m, p = cfg.recompute, cfg.model, cfg.parallel
    counts = stage_layer_counts(m.num_layers, p.pp, p.vpp, p.first_stage_layers, p.last_stage_layers)
    if r.granularity != "full" or counts is None:
        return
    chunk_sizes = sorted({c // p.vpp for c in counts})
    per_chunk = chunk_sizes[0]
    fields = {"recompute.method": r.method, "recompute.num_layers": r.num_layers, "layers per model chunk": per_chunk}
    if r.num_layers < 1:
        yield _err(
            "recompute_layers",
            fields,
            "full recompute needs at least one layer per checkpoint",
            "set recompute.num_layers=1",
        )
    elif r.method == "uniform" and any(size % r.num_layers for size in chunk_sizes):
        common = [d for d in _divisors(per_chunk) if all(size % d == 0 for size in chunk_sizes)]
        yield _err(
            "recompute_layers",
            fields,
            "uniform recompute checkpoints groups of num_layers, which must tile each chunk",
            f"use recompute.num_layers in {{{_listing(common)}}}",
        )
    elif r.method == "block" and r.num_layers > per_chunk:
        yield _err(
            "recompute_layers",
            fields,
            "block recompute cannot recompute more layers than a chunk holds",
            f"use recompute.num_layers<={per_chunk}",
        )


def _optim(cfg: Config) -> Iterator[Violation]:
    o = cfg.optim
    if o.min_lr > o.lr:
        yield _err(
            "min_lr",
            {"optim.lr": o.lr, "optim.min_lr": o.min_lr},
            "the decay would raise the learning rate",
            f"set optim.min_lr<={o.lr} (e.g. {o.lr / 10:g})",
        )
    if o.lr_scaling != "none" and not o.reference_global_batch:
        yield _err(
            "lr_reference",
            {"optim.lr_scaling": o.lr_scaling, "optim.reference_global_batch": o.reference_global_batch},
            "a rescaling rule needs the batch the learning rate was tuned at",
            f"set optim.reference_global_batch to that batch (e.g. {cfg.train.global_batch})",
        )


def _checkpoint(cfg: Config) -> Iterator[Violation]:
    c = cfg.checkpoint
    if c.auto_interval and c.interval_steps:
        yield _err(
            "checkpoint_interval",
            {"checkpoint.auto_interval": True, "checkpoint.interval_steps": c.interval_steps},
            "two save intervals given: the planner's rule picks the interval in steps",
            "set checkpoint.interval_steps=null, or checkpoint.auto_interval=false",
        )
    be = backend_of(cfg)
    if c.async_save and not be.async_save:
        yield _err(
            "async_save_backend",
            {"checkpoint.async_save": True, "backend.name": be.name},
            "parakit's asynchronous save uses megatron-core's dist_checkpointing",
            f"use checkpoint.async_save=false on the {be.name} backend, or {_others(lambda o: o.async_save)}",
        )


# ---------------------------------------------------------------- slow-but-valid layouts
def _warnings(cfg: Config, layout: Layout) -> Iterator[Violation]:
    p, c, o, t, ch = cfg.parallel, cfg.cluster, cfg.optim, cfg.train, cfg.checks
    m = layout.num_microbatches
    if p.pp > 1:
        bubble = bubble_fraction(p.pp, p.vpp, m)
        if bubble > ch.max_bubble_fraction:
            need = math.ceil((p.pp - 1) / (p.vpp * ch.max_bubble_fraction))
            yield _warn(
                "bubble",
                {"parallel.pp": p.pp, "parallel.vpp": p.vpp, "micro-batches": m},
                f"the pipeline bubble (pp-1)/(vpp*m) adds {bubble:.0%} idle time to the compute (threshold "
                f"{ch.max_bubble_fraction:.0%})",
                f"raise train.global_batch so that m >= {need} (global_batch >= {need * t.micro_batch * layout.dp}), "
                "lower train.micro_batch, or raise parallel.vpp",
            )
        if m < ch.min_microbatches_per_stage * p.pp:
            yield _warn(
                "few_microbatches",
                {"micro-batches": m, "parallel.pp": p.pp},
                f"fewer than {ch.min_microbatches_per_stage}*pp micro-batches per step keep the pipeline mostly "
                "filling and draining",
                f"raise train.global_batch to {ch.min_microbatches_per_stage * p.pp * t.micro_batch * layout.dp} or "
                "lower train.micro_batch",
            )
    if p.tp <= c.gpus_per_node and c.gpus_per_node % p.tp and c.nodes > 1:
        yield _warn(
            "tp_spans_nodes",
            {"parallel.tp": p.tp, "cluster.gpus_per_node": c.gpus_per_node},
            "some tensor-parallel groups straddle two nodes and talk over the slow inter-node network",
            f"use parallel.tp in {{{_listing(_divisors(c.gpus_per_node))}}}",
        )
    if p.tp & (p.tp - 1):
        yield _warn(
            "tp_power_of_two",
            {"parallel.tp": p.tp},
            "tensor parallel degrees that are not powers of two give odd GEMM shapes and unbalanced NVLink traffic",
            "use parallel.tp in {1, 2, 4, 8}",
        )
    if o.reference_global_batch and o.reference_global_batch != t.global_batch and o.lr_scaling == "none":
        yield _warn(
            "lr_not_rescaled",
            {
                "train.global_batch": t.global_batch,
                "optim.reference_global_batch": o.reference_global_batch,
                "optim.lr_scaling": "none",
            },
            "the global batch changed but the learning rate and warmup did not",
            "set optim.lr_scaling=sqrt (Adam) or linear (SGD), or retune optim.lr and optim.warmup_steps",
        )
    if layout.warmup_steps >= layout.steps:
        yield _warn(
            "warmup",
            {"optim.warmup_steps": layout.warmup_steps, "steps": layout.steps},
            "the run ends before the learning-rate warmup does",
            f"set optim.warmup_steps<={max(1, layout.steps // 10)}",
        )


# ---------------------------------------------------------------- the training data
def _split(text: str) -> list[float] | None:
    """data.split as Megatron-LM reads it: up to three comma-separated non-negative shares."""
    try:
        shares = [float(part) for part in text.replace("/", ",").split(",")]
    except ValueError:
        return None
    if not 1 <= len(shares) <= 3 or any(not math.isfinite(x) or x < 0 for x in shares) or shares[0] <= 0:
        return None
    return shares + [0.0] * (3 - len(shares))


def _prefixes(d) -> Iterator[Violation | str]:
    """data.path's prefixes, or the violations that make them unreadable."""
    try:
        prefixes, _ = parse_blend(d.path)
    except ValueError as e:
        yield _err("data_path", {"data.path": d.path}, str(e), "give one prefix, or 'W1 PREFIX1 W2 PREFIX2 ...'")
        return
    for prefix in prefixes:
        missing = [s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
        if missing:
            yield _err(
                "data_path",
                {"data.path": prefix},
                f"no {' or '.join(prefix + s for s in missing)}",
                f"prepare it: parakit data prepare FILES... --output {prefix}",
            )
        else:
            yield prefix


def _data(cfg: Config) -> Iterator[Violation]:
    """The data exists, every token id of its tokenizer has an embedding row, the blend's parts
    share one tokenizer, and the split leaves validation documents when evaluation is asked for."""
    d, m = cfg.data, cfg.model
    shares = _split(d.split)
    if shares is None:
        yield _err(
            "data_split",
            {"data.split": d.split},
            "not train,valid,test shares (non-negative numbers, train above 0)",
            "use e.g. data.split='98,2,0' (quoted: Hydra reads a bare 98,2,0 as a sweep)",
        )
    elif d.name == DataName.corpus and cfg.train.eval_interval and shares[1] == 0:
        yield _err(
            "eval_split",
            {"train.eval_interval": cfg.train.eval_interval, "data.split": d.split},
            "evaluation needs validation documents, and the split gives them none",
            "give the validation part a share, e.g. data.split='98,2,0', or set train.eval_interval=null",
        )
    if d.name != DataName.corpus:
        return
    vocabularies = {}  # tokenizer -> (vocab, prefixes)
    if d.path:
        for item in _prefixes(d):
            if isinstance(item, Violation):
                yield item
                continue
            try:  # the ranks read it too (toolkit.train.data)
                manifest = read_manifest(item)
            except (ValueError, TypeError, AttributeError) as e:
                yield _err(
                    "data_manifest",
                    {"data.path": item},
                    f"{manifest_path(item)} is not a manifest parakit data prepare wrote ({type(e).__name__}: {e})",
                    f"prepare it again: parakit data prepare FILES... --output {item} --overwrite",
                )
                continue
            key = (manifest.tokenizer, manifest.vocab_size, manifest.eod) if manifest else (d.tokenizer, None, None)
            vocabularies.setdefault(key, []).append(item)
    else:
        vocabularies[(d.tokenizer, None, None)] = ["the bundled corpus"]
    if len(vocabularies) > 1:
        yield _err(
            "data_tokenizer",
            {"data.path": d.path},
            "the blend's datasets were tokenized differently: "
            + "; ".join(
                f"{', '.join(p)} with {t} ({v or TOKENIZER_VOCAB.get(t)} tokens)"
                for (t, v, _), p in vocabularies.items()
            ),
            "prepare every part with the same --tokenizer",
        )
    for (tokenizer, vocab, _), prefixes in vocabularies.items():
        tokens = vocab or TOKENIZER_VOCAB.get(tokenizer)
        if tokens is not None and m.vocab_size < tokens:
            yield _err(
                "vocab_tokenizer",
                {
                    "model.vocab_size": m.vocab_size,
                    "data.name": d.name,
                    "data.path": d.path,
                    "data.tokenizer": tokenizer,
                },
                f"{', '.join(prefixes)} is tokenized with {tokenizer} ({tokens} tokens): token ids from "
                f"{m.vocab_size} up have no embedding row",
                f"set model.vocab_size={tokens} (or larger), or use data=synthetic (random tokens below "
                "model.vocab_size)",
            )


_ERROR_RULES: tuple[Callable[[Config], Iterator[Violation]], ...] = (
    _model,
    _rope,
    _parallel,
    _batch,
    _backend,
    _precision,
    _recompute,
    _optim,
    _checkpoint,
)


def _memory(cfg: Config) -> Iterator[Violation]:
    """Will it fit: the planner's peak memory on the busiest rank against the device's
    (toolkit.plan.fit names the largest term and the smallest change that fits)."""
    if cfg.checks.memory == "off":
        return
    problem = memory_problem(cfg, lambda changed: validate(changed, data=False, memory=False).ok)
    if problem:
        severity = _err if problem.certain and cfg.checks.memory == "error" else _warn
        yield severity("memory", problem.fields, problem.message, problem.fix)


def _missing_packages(packages: tuple[Package, ...], installed: Callable[[str], bool]) -> Iterator[Violation]:
    """On the machine that trains: the packages the options need and this machine cannot import."""
    for package in packages:
        if not installed(package.module):
            yield _err(
                "package",
                {package.field: package.value},
                f"{package.why}, and this machine cannot import {package.module}",
                f"pip install {package.install} on the machines that train, or {package.instead}",
            )


def validate(
    cfg: Config, *, data: bool = True, memory: bool = True, installed: Callable[[str], bool] | None = None
) -> Report:
    """Every error and warning of `cfg`, at once. `data=False` leaves out the rules about the
    training data (the layout search: a layout does not depend on the data); `memory=False` the
    memory check (the search weighs memory itself). `installed(module)` says whether this machine
    imports a module: given on the machine that trains, a package an option needs and this machine
    lacks is an error; without it (planning elsewhere) the report lists what the options need."""
    errors = list(_ranges(cfg))
    packages: tuple[Package, ...] = ()
    if not any(e.rule == "range" for e in errors):  # the other rules divide by these values
        for rule in _ERROR_RULES:
            errors.extend(rule(cfg))
        if data:
            errors.extend(_data(cfg))
        packages = tuple(packages_needed(cfg))
        if installed is not None:
            errors.extend(_missing_packages(packages, installed))
    warnings = []
    if not errors and memory:
        found = list(_memory(cfg))
        errors += [v for v in found if v.severity == ERROR]
        warnings += [v for v in found if v.severity != ERROR]
    if not errors:
        warnings += list(_warnings(cfg, resolve(cfg)))
    return Report(tuple(errors), tuple(warnings), packages)


def check(cfg: Config, installed: Callable[[str], bool] | None = None) -> tuple[Layout, Report]:
    """The resolved layout and the report's warnings; raises `ValidationError` on errors."""
    report = validate(cfg, installed=installed)
    if not report.ok:
        raise ValidationError(report)
    return resolve(cfg), report
