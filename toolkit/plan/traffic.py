"""The data-parallel traffic of a layout and what each remedy would save: the guide's answer once
data parallel reaches its limit (gradient accumulation, and cheaper synchronisation: hierarchical
or compressed), priced by the step-time model (toolkit.plan.perf.data_parallel_comm) and checked
by the validator, so that only what the backend, the ZeRO stage and the device can run is offered."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from toolkit.config.schema import Config
from toolkit.plan.layout import Layout, resolve, world_size
from toolkit.plan.memory import MemoryEstimate, peak_memory
from toolkit.plan.perf import StepEstimate, estimate_step
from toolkit.plan.validate import validate


@dataclass(frozen=True)
class Remedy:
    overrides: tuple[str, ...]  # the Hydra overrides that apply it
    what: str  # what it changes, in a few words
    cfg: Config  # the configuration with it, its layout and the planner's estimates for it
    layout: Layout
    step: StepEstimate
    memory: MemoryEstimate
    memory_delta: float  # bytes per GPU it adds (negative: frees)

    @property
    def step_time(self) -> float:
        return self.step.step_time


@dataclass(frozen=True)
class _Change:
    overrides: str
    sections: dict  # {config section: {field: value}}
    what: str
    same_numerics: bool  # the same update up to the order of the sums (a layout choice, not a numerical one)


def _changes(cfg: Config, layout: Layout) -> list[_Change]:
    """Each remedy worth pricing for this layout."""
    c, comm, out = cfg.cluster, cfg.comm, []
    if cfg.precision.dtype != "fp32" and cfg.precision.grad_reduce_in_fp32:
        what = "reduce gradients in 16 bits: half the bytes"
        out.append(
            _Change("precision.grad_reduce_in_fp32=false", {"precision": {"grad_reduce_in_fp32": False}}, what, False)
        )
    if not cfg.zero.overlap_comm:
        out.append(
            _Change("zero.overlap_comm=true", {"zero": {"overlap_comm": True}}, "overlap it with the compute", True)
        )
    ranks, stride = layout.dp * layout.cp, layout.dims.stride("cp")
    per_node = max(1, c.gpus_per_node // stride)  # the dp x cp ranks one node holds
    if ranks > per_node and ranks % per_node == 0 and comm.optimizer_instances == 1:
        n = ranks // per_node
        what = f"the optimizer sharded inside each node, {n} replicas: reduce-scatter in the node, 1/{per_node} across"
        out.append(_Change(f"comm.optimizer_instances={n}", {"comm": {"optimizer_instances": n}}, what, True))
    world = world_size(cfg)
    if world > c.gpus_per_node and comm.hpz_partition_size == 1:
        what = "hpZ: the backward's parameter all-gathers inside a node"
        size = c.gpus_per_node
        out.append(_Change(f"comm.hpz_partition_size={size}", {"comm": {"hpz_partition_size": size}}, what, True))
    if not comm.quantized_weights:
        what = "qwZ: parameters all-gathered in int8"
        out.append(_Change("comm.quantized_weights=true", {"comm": {"quantized_weights": True}}, what, False))
    if not comm.quantized_gradients:
        what = "qgZ: gradients reduced in int4, node first"
        out.append(_Change("comm.quantized_gradients=true", {"comm": {"quantized_gradients": True}}, what, False))
    zeropp = {"hpz_partition_size": min(c.gpus_per_node, world), "quantized_weights": True, "quantized_gradients": True}
    if world > c.gpus_per_node and any(getattr(comm, k) != v for k, v in zeropp.items()):
        settings = " ".join(f"comm.{k}={str(v).lower()}" for k, v in zeropp.items())
        out.append(_Change(settings, {"comm": zeropp}, "ZeRO++ whole: hpZ, qwZ and qgZ", False))
    return out


def _applied(cfg: Config, sections: dict) -> Config:
    return dataclasses.replace(
        cfg, **{name: dataclasses.replace(getattr(cfg, name), **values) for name, values in sections.items()}
    )


def remedies(
    cfg: Config, layout: Layout, step: StepEstimate | None = None, same_numerics: bool = False
) -> list[Remedy]:
    """The remedies this configuration can run, best first, each with the step it predicts; those
    that would not shorten the step are left out (`same_numerics`: only those that change no
    number the training computes beyond the order of its sums, as the layout search may choose)."""
    step = step or estimate_step(cfg, layout)
    memory = peak_memory(cfg, layout).total
    found = []
    for change in _changes(cfg, layout):
        if same_numerics and not change.same_numerics:
            continue
        changed = _applied(cfg, change.sections)
        if not validate(changed, data=False, memory=False).ok:  # the backend, stage or device cannot
            continue
        changed_layout = resolve(changed)
        new = estimate_step(changed, changed_layout)
        if new.step_time < step.step_time:
            peak = peak_memory(changed, changed_layout)
            overrides = tuple(change.overrides.split())
            found.append(Remedy(overrides, change.what, changed, changed_layout, new, peak, peak.total - memory))
    return sorted(found, key=lambda r: r.step_time)


def traffic_lines(cfg: Config, layout: Layout, step: StepEstimate) -> list[str]:
    """The gradient traffic's share of the step and what each remedy saves, for `parakit plan`."""
    if layout.dp * layout.cp == 1:
        return ["data-parallel traffic: none (one replica)"]
    share = step.dp_comm / step.step_time
    lines = [
        f"data-parallel traffic (gradients and parameters): {step.dp_comm:.3g} s exposed, {share:.0%} of the "
        f"{step.step_time:.3g} s step"
    ]
    found = remedies(cfg, layout, step)
    for r in found:
        saving = 1 - r.step_time / step.step_time
        memory = f", {r.memory_delta / 2**30:+.1f} GiB per GPU" if abs(r.memory_delta) >= 0.05 * 2**30 else ""
        lines.append(f"  {' '.join(r.overrides)}: step -{saving:.1%}{memory} ({r.what})")
    if not found:
        lines.append("  no traffic setting of this backend, ZeRO stage and device shortens it")
    return lines
