"""What the configured backend cannot run, read from its description (toolkit.plan.backends) as a
table: each capability names the fields that ask for it, how a backend description says whether
it can, the message, and a fix that lists the backends that can."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable, Iterator

from toolkit.config.schema import CommConfig, Config, is_moe
from toolkit.families import family_of
from toolkit.plan.backends import Backend, backend_of, supporting
from toolkit.plan.rules.base import Violation, err, listing, others


@dataclass(frozen=True)
class Capability:
    rule: str  # its id; {b} is the backend's name, {dtype} the precision's
    asks: Callable[[Config, Backend], dict]  # the fields that ask for it and their values; {} when not asked
    can: Callable[[Backend, Config], bool]  # whether a backend runs what cfg asks
    message: Callable[[Config, Backend], str]
    fix: Callable[[Config, Backend, str], str]  # given the backends that can ("backend=X or backend=Y")


def _uneven(cfg: Config, be: Backend) -> dict:
    p = cfg.parallel
    if p.first_stage_layers is None and p.last_stage_layers is None:
        return {}
    return {"parallel.first_stage_layers": p.first_stage_layers, "parallel.last_stage_layers": p.last_stage_layers}


def _nan_skip(cfg: Config, be: Backend) -> dict:
    asked = cfg.train.fault.nan_action == "skip" and cfg.zero.stage == 0 and cfg.precision.dtype == "fp32"
    return {"train.fault.nan_action": "skip", "zero.stage": 0, "precision.dtype": "fp32"} if asked else {}


def _unapplied(cfg: Config, be: Backend) -> dict:
    """The llama3 scaling parameters set otherwise than the backend applies them: {name: its value}."""
    return {k: v for k, v in be.rope_scaling_fixed if getattr(cfg.model.rope_scaling, k) != v}


def _rope_fixed(cfg: Config, be: Backend) -> dict:
    rs = cfg.model.rope_scaling
    if rs.type == "none":
        return {}
    return {f"model.rope_scaling.{k}": getattr(rs, k) for k in _unapplied(cfg, be)}


def _fractional_rope_base(cfg: Config, be: Backend) -> dict:
    m = cfg.model
    fractional = m.position_embedding == "rope" and math.isfinite(m.rotary_base) and m.rotary_base != int(m.rotary_base)
    return {"model.rotary_base": m.rotary_base} if fractional else {}


def _init_weights(cfg: Config, be: Backend) -> dict:
    given = {k: getattr(cfg.train, k) for k in ("init_checkpoint", "save_init_checkpoint")}
    return {f"train.{k}": v for k, v in given.items() if v}


def _offload(cfg: Config, be: Backend) -> dict:
    z = cfg.zero
    if z.offload_optimizer == "none" and z.offload_param == "none":
        return {}
    return {"zero.offload_optimizer": z.offload_optimizer, "zero.offload_param": z.offload_param}


def _set_rope(cfg: Config, be: Backend, can: str) -> str:
    settings = " and ".join(f"model.rope_scaling.{k}={v:g}" for k, v in _unapplied(cfg, be).items())
    return f"set {settings}, or {can}"


def _comm(cfg: Config, be: Backend | None = None) -> dict:
    """The comm.* options set otherwise than their defaults."""
    default = CommConfig()
    return {
        f"comm.{f.name}": getattr(cfg.comm, f.name)
        for f in fields(CommConfig)
        if getattr(cfg.comm, f.name) != getattr(default, f.name)
    }


def _leave_default(names: list[str]) -> str:
    return f"leave {listing(names)} at {'its default' if len(names) == 1 else 'their defaults'}"


def _moe(cfg: Config, be: Backend) -> dict:
    return {"model.moe.num_experts": cfg.model.moe.num_experts} if is_moe(cfg.model) else {}


def _unexpressed(cfg: Config) -> dict:
    return family_of(cfg.model.family).unexpressed(cfg.model) if is_moe(cfg.model) else {}


def _family_settings(cfg: Config) -> dict:
    return {field: u.value for field, u in _unexpressed(cfg).items()}


def _moe_option(asked: Callable[[Config], dict]) -> Callable[[Config, Backend], dict]:
    """`asked`'s fields where the model has experts and the backend trains some (else moe_backend says it)."""
    return lambda cfg, be: asked(cfg) if is_moe(cfg.model) and be.moe else {}


def _override_value(value) -> str:
    """A value as a Hydra override writes it."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _express(cfg: Config, be: Backend, can: str) -> str:
    settings = " and ".join(f"{field}={_override_value(u.expressed)}" for field, u in _unexpressed(cfg).items())
    return f"set {settings}, or {can}"


# In the order they are reported. The fields of each violation are what `asks` returns, plus
# backend.name (except for the sliding window, whose fix names the backend).
CAPABILITIES: tuple[Capability, ...] = (
    Capability(
        "moe_backend",
        _moe,
        lambda be, cfg: be.moe is not None,
        lambda cfg, be: f"the {be.name} backend trains dense models only",
        lambda cfg, be, can: f"use {can}",
    ),
    Capability(
        "moe_family_backend",
        _moe_option(_family_settings),
        lambda be, cfg: be.moe is not None and not be.moe.family_modules,
        lambda cfg, be: (
            f"the {be.name} backend trains transformers' {cfg.model.family} MoE blocks, which "
            + "; ".join(sorted({u.why for u in _unexpressed(cfg).values()}))
        ),
        _express,
    ),
    Capability(
        "moe_grouped_gemm_backend",
        _moe_option(lambda cfg: {"model.moe.grouped_gemm": True} if cfg.model.moe.grouped_gemm else {}),
        lambda be, cfg: be.moe is not None and be.moe.grouped_gemm,
        lambda cfg, be: f"the {be.name} backend runs each expert's own GEMMs (transformers' experts loop)",
        lambda cfg, be, can: f"set model.moe.grouped_gemm=false, or {can}",
    ),
    Capability(
        "moe_pipeline_backend",
        _moe_option(lambda cfg: {"parallel.pp": cfg.parallel.pp} if cfg.parallel.pp > 1 else {}),
        lambda be, cfg: be.moe is not None and be.moe.pipeline,
        lambda cfg, be: (
            f"the {be.name} pipeline passes only the hidden states between stages, and the routers' "
            "logits would have to travel with them for the load-balancing loss"
        ),
        lambda cfg, be, can: f"use parallel.pp=1 (ZeRO shards the model instead), or {can}",
    ),
    Capability(
        "zero_pipeline",
        lambda cfg, be: {"zero.stage": cfg.zero.stage, "parallel.pp": cfg.parallel.pp} if cfg.parallel.pp > 1 else {},
        lambda be, cfg: cfg.zero.stage not in be.zero_stages or cfg.zero.stage in be.pipeline_zero_stages,
        lambda cfg, be: (
            f"the {be.name} backend's pipeline engine supports ZeRO stage {listing(be.pipeline_zero_stages)} only"
        ),
        lambda cfg, be, can: (
            f"use zero={max(be.pipeline_zero_stages)} with pipeline parallel, or parallel.pp=1 "
            f"with ZeRO-{cfg.zero.stage}"
        ),
    ),
    Capability(
        "pipeline_sliding_window",
        lambda cfg, be: (
            {"parallel.pp": cfg.parallel.pp, "model.sliding_window": cfg.model.sliding_window}
            if cfg.parallel.pp > 1 and cfg.model.sliding_window
            else {}
        ),
        lambda be, cfg: be.pipeline_sliding_window,
        lambda cfg, be: f"the {be.name} pipeline stages run decoder layers without the model's sliding-window mask",
        lambda cfg, be, can: f"use parallel.pp=1 on the {be.name} backend, or {can}",
    ),
    Capability(
        "pipeline_tied_embeddings",
        lambda cfg, be: (
            {"parallel.pp": cfg.parallel.pp, "model.tie_embeddings": True}
            if cfg.parallel.pp > 1 and cfg.model.tie_embeddings
            else {}
        ),
        lambda be, cfg: be.pipeline_tied_embeddings,
        lambda cfg, be: f"the {be.name} pipeline keeps the input embedding and the output head on different stages",
        lambda cfg, be, can: f"use parallel.pp=1, model.tie_embeddings=false, or {can}",
    ),
    Capability(
        "uneven_pipeline_backend",
        _uneven,
        lambda be, cfg: be.uneven_pipeline_stages,
        lambda cfg, be: f"the {be.name} pipeline balances the decoder layers over its stages itself",
        lambda cfg, be, can: "set parallel.first_stage_layers=null and parallel.last_stage_layers=null, or " + can,
    ),
    Capability(
        "{dtype}_backend",
        lambda cfg, be: {"precision.dtype": cfg.precision.dtype},
        lambda be, cfg: cfg.precision.dtype in be.precisions,
        lambda cfg, be: f"the {be.name} backend trains in {listing(be.precisions)}",
        lambda cfg, be, can: f"use precision=bf16 or {can}",
    ),
    Capability(
        # DeepSpeed drops an update with non-finite gradients only in its fp16/bf16 and ZeRO optimizers.
        "nan_action_backend",
        _nan_skip,
        lambda be, cfg: not be.nan_skip_needs_overflow_check,
        lambda cfg, be: (
            f"the {be.name} backend's plain fp32 optimizer applies an update even when its gradients are NaN"
        ),
        lambda cfg, be, can: f"use zero=1 (or higher), precision=bf16, train.fault.nan_action=stop, or {can}",
    ),
    Capability(
        "recompute_backend",
        lambda cfg, be: {"recompute.granularity": cfg.recompute.granularity},
        lambda be, cfg: cfg.recompute.granularity in be.recompute,
        lambda cfg, be: f"the {be.name} backend recomputes {listing(be.recompute)} only",
        lambda cfg, be, can: f"use recompute=full or {can}",
    ),
    Capability(
        "rope_scaling_backend",
        _rope_fixed,
        lambda be, cfg: not be.rope_scaling_fixed,
        lambda cfg, be: (
            f"the {be.name} backend sets only the llama3 scaling factor; it applies "
            + ", ".join(f"{k}={v:g}" for k, v in be.rope_scaling_fixed)
        ),
        _set_rope,
    ),
    Capability(
        # megatron_args.txt must say what megatron.yaml says, and Megatron-LM parses --rotary-base as int.
        "rotary_base_integer",
        _fractional_rope_base,
        lambda be, cfg: not be.megatron_lm_entry,
        lambda cfg, be: f"the {be.name} backend's Megatron-LM command line takes an integer RoPE base (--rotary-base)",
        lambda cfg, be, can: f"set model.rotary_base={round(cfg.model.rotary_base)}, or {can}",
    ),
    Capability(
        "hf_path_backend",
        lambda cfg, be: {"model.hf_path": cfg.model.hf_path} if cfg.model.hf_path else {},
        lambda be, cfg: bool(be.hf_weights),
        lambda cfg, be: f"Hugging Face weights load on the {others(lambda o: o.hf_weights)} backend",
        lambda cfg, be, can: (
            f"use {can}, or convert them (parakit convert hf-to-megatron) and set train.init_checkpoint"
        ),
    ),
    Capability(
        "init_weights_backend",
        _init_weights,
        lambda be, cfg: be.dist_init_weights,
        lambda cfg, be: (
            f"the {be.name} backend would ignore it: initial weights as a megatron-core dist checkpoint "
            f"are loaded and saved by the {' and '.join(supporting(lambda o: o.dist_init_weights))} backend"
        ),
        lambda cfg, be, can: (
            f"use {can}, or start {be.name} from Hugging Face weights (model.hf_path; "
            "python -m toolkit.interop.megatron_to_hf converts such a checkpoint)"
        ),
    ),
    Capability(
        "zero_{b}",
        lambda cfg, be: {"zero.stage": cfg.zero.stage},
        lambda be, cfg: cfg.zero.stage in be.zero_stages,
        lambda cfg, be: f"the {be.name} backend runs ZeRO stage {listing(be.zero_stages)} ({be.zero_meaning})",
        lambda cfg, be, can: f"use zero={max(be.zero_stages)} on {be.name}, or {can} for ZeRO-{cfg.zero.stage}",
    ),
    Capability(
        "offload_backend",
        _offload,
        lambda be, cfg: be.offload,
        lambda cfg, be: "offload is a DeepSpeed ZeRO feature here",
        lambda cfg, be, can: f"use {can}, or zero.offload_*=none",
    ),
    Capability(
        "comm_backend",
        _comm,
        lambda be, cfg: {name.removeprefix("comm.") for name in _comm(cfg)} <= be.comm_options,
        lambda cfg, be: (
            f"the {be.name} backend's data-parallel traffic has only "
            + listing(sorted(f"comm.{o}" for o in be.comm_options))
            + " of these options"
        ),
        lambda cfg, be, can: (
            _leave_default([k for k in _comm(cfg) if k.removeprefix("comm.") not in be.comm_options])
            + (f", or use {can}" if can else "")
        ),
    ),
    Capability(
        "async_save_backend",
        lambda cfg, be: {"checkpoint.async_save": True} if cfg.checkpoint.async_save else {},
        lambda be, cfg: be.async_save,
        lambda cfg, be: "parakit's asynchronous save uses megatron-core's dist_checkpointing",
        lambda cfg, be, can: f"use checkpoint.async_save=false on the {be.name} backend, or {can}",
    ),
)
# The capabilities whose violation does not name backend.name (their fix does).
_WITHOUT_BACKEND_FIELD = {"pipeline_sliding_window"}


def backend(cfg: Config) -> Iterator[Violation]:
    be = backend_of(cfg)
    for capability in CAPABILITIES:
        fields = capability.asks(cfg, be)
        if not fields or capability.can(be, cfg):
            continue
        if capability.rule not in _WITHOUT_BACKEND_FIELD:
            fields = {**fields, "backend.name": be.name}
        can = others(lambda o, capability=capability: capability.can(o, cfg))
        yield err(
            capability.rule.format(b=be.name, dtype=cfg.precision.dtype),
            fields,
            capability.message(cfg, be),
            capability.fix(cfg, be, can),
        )
