"""`parakit plan`: the configured layout's estimate, the layout search, the decision path
and the checkpoint interval, as a table for people or JSON for machines."""

from __future__ import annotations

import json
import sys

from toolkit.config.schema import Config
from toolkit.plan.checkpoint import checkpoint_plan, saves_asynchronously
from toolkit.plan.layout import resolve, world_size
from toolkit.plan.memory import GIB, peak_memory
from toolkit.plan.parallel_dims import DIMS, ParallelDims
from toolkit.plan.params import model_params
from toolkit.plan.perf import estimate_step
from toolkit.plan.search import Candidate, decision_path, search, unsearchable
from toolkit.plan.traffic import remedies, traffic_lines
from toolkit.plan.validate import validate


def _columns() -> tuple[str, ...]:
    return (
        "#",
        *(d.name for d in DIMS),
        "mbs",
        "zero",
        "recompute",
        "mem GiB",
        "bubble",
        "comm",
        "tok/s",
        "TFLOP/s",
        "MFU",
    )


def _row(rank: int, c: Candidate) -> tuple:
    d = c.describe()
    return (
        rank,
        *(degree for _, degree in c.layout.dims.items()),
        d["micro_batch"],
        d["zero"],
        d["recompute"],
        f"{d['memory_gib']:.1f}",
        f"{d['bubble']:.1%}",
        f"{d['comm_share']:.0%}",
        f"{d['tokens_per_s']:,.0f}",
        f"{d['tflops_per_gpu']:.0f}",
        f"{d['mfu']:.1%}",
    )


def _table(rows: list[tuple]) -> str:
    columns = _columns()
    widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(len(columns))]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join(fmt.format(*map(str, r)) for r in [columns, *rows])


def configured_estimate(cfg: Config) -> dict:
    report = validate(cfg, data=False, memory=False)  # the estimate says whether it fits
    if not report.ok:
        return {"valid": False, "errors": [str(e) for e in report.errors]}
    layout = resolve(cfg)
    step, memory = estimate_step(cfg, layout), peak_memory(cfg, layout)
    return {
        "valid": True,
        "candidate": Candidate(cfg, layout, memory, step).describe(),
        "traffic": {
            "dp_comm_s": step.dp_comm,
            "share": step.dp_comm / step.step_time,
            "remedies": [
                {
                    "overrides": list(r.overrides),
                    "what": r.what,
                    "step_time_s": r.step_time,
                    "memory_delta": r.memory_delta,
                }
                for r in remedies(cfg, layout, step)
            ],
        },
        "traffic_lines": traffic_lines(cfg, layout, step),
        "fits": memory.total <= cfg.cluster.gpu_memory_gb * 1e9,
        "warnings": [str(w) for w in report.warnings],
        "packages": [p.install for p in report.packages],  # what the machines that train need
    }


def plan_command(cfg: Config, top: int = 10, as_json: bool = False) -> int:
    result = search(cfg)
    path = decision_path(cfg, result)
    configured = configured_estimate(cfg)
    best = result.ranked[0] if result.ranked else None
    ckpt = checkpoint_plan(best.cfg, best.layout, best.step.step_time) if best else None
    if as_json:
        _print_json(cfg, result, path, configured, ckpt, top)
    else:
        _print_text(cfg, result, path, configured, ckpt, top)
    return 0 if best else 2


def _print_json(cfg, result, path, configured, ckpt, top) -> None:
    out = {
        "model": cfg.model.name,
        "parameters": model_params(cfg.model),
        "cluster": cfg.cluster.name,
        "gpus": world_size(cfg),
        "global_batch": cfg.train.global_batch,
        "seq_length": cfg.model.seq_length,
        "precision": cfg.precision.dtype,
        "backend": cfg.backend.name,
        "configured": {k: v for k, v in configured.items() if k != "traffic_lines"},
        "decision_path": path,
        "layouts": [c.describe() for c in result.ranked[:top]],
        "search": {
            "considered": result.considered,
            "valid": result.valid,
            "fitting": result.fitting,
            "seconds": result.seconds,
        },
        "checkpoint": ckpt.__dict__ | {"overhead": ckpt.overhead} if ckpt else None,
    }
    print(json.dumps(out, indent=2, default=float))


def _print_text(cfg, result, path, configured, ckpt, top) -> None:
    c = cfg.cluster
    memory = f"{c.gpu_memory_gb:g} GB" if c.gpu_memory_gb else "memory not given"
    print(
        f"{cfg.model.name} ({model_params(cfg.model) / 1e9:.2f}B parameters) on {c.name}: {world_size(cfg)} x {c.gpu} "
        f"({memory}), global batch {cfg.train.global_batch} x {cfg.model.seq_length} tokens, "
        f"{cfg.precision.dtype}, backend {cfg.backend.name}"
    )
    if configured["valid"]:
        d = configured["candidate"]
        dims = ParallelDims(**{dim.name: d[dim.name] for dim in DIMS})
        print(
            f"\nconfigured layout: {dims.label()} micro {d['micro_batch']}, "
            f"zero {d['zero']}, recompute {d['recompute']}: {d['memory_gib']:.1f} GiB per GPU "
            f"({'fits' if configured['fits'] else 'DOES NOT FIT'}), {d['tokens_per_s']:,.0f} tokens/s, MFU "
            f"{d['mfu']:.1%}"
        )
        print("  memory: " + ", ".join(f"{k} {v:.1f}" for k, v in d["memory_breakdown_gib"].items()) + " GiB")
        if configured["packages"]:
            print(f"  needs on the machines that train: {', '.join(configured['packages'])}")
        for line in configured["traffic_lines"]:
            print(f"  {line}")
    else:
        print("\nconfigured layout is not valid (the search below ignores it):")
        for error in configured["errors"]:
            print(f"  {error}")
    if not result.considered and not unsearchable(cfg):  # the enumeration came up empty: the size and the batch
        print(
            f"\nno layout to search: no split of {world_size(cfg):,} GPUs into tp x pp x cp x dp suits the model and "
            f"leaves a data-parallel size that divides train.global_batch={cfg.train.global_batch}; change the batch "
            "or the number of GPUs"
        )
        print(f"\nsearched 0 layouts; {result.seconds:.2f} s", file=sys.stderr)
        return
    if not result.valid:  # not a question of memory: no layout escapes the errors
        print("\nno layout of the search is valid either: the errors above do not depend on the layout; fix them first")
        print(f"\nsearched {result.considered} layouts: 0 valid; {result.seconds:.2f} s", file=sys.stderr)
        return
    print("\ndecision path (one GPU -> data parallel; one node -> tensor parallel; more -> pipeline across nodes):")
    for line in path:
        print(f"  {line}")
    if not result.ranked:
        smallest = result.smallest
        need = f"; the smallest needs {smallest.memory.total / GIB:.1f} GiB" if smallest else ""
        print(f"\nno layout fits in {c.gpu_memory_gb:g} GB with 10% headroom{need}")
    else:
        print(f"\ntop {min(top, len(result.ranked))} layouts by predicted throughput (memory with 10% headroom):")
        rows = result.ranked[:top]
        print(_table([_row(i + 1, r) for i, r in enumerate(rows)]))
        for i, r in enumerate(rows):
            print(f"  {i + 1}. {r.reason()}")
        print(f"\nuse #1: parakit generate {' '.join(rows[0].overrides())} [your model/cluster/batch overrides]")
    if ckpt:
        source = "measured" if ckpt.save_measured else "estimated"
        if saves_asynchronously(cfg):
            source += f"; asynchronous: training held up that long, the writes take {ckpt.write_seconds:.0f} s"
        print(
            f"\ncheckpointing (layout #1): save {ckpt.save_seconds:.3g} s ({source}); job MTBF "
            f"{ckpt.job_mtbf_hours:.1f} h "
            f"({c.gpu_mtbf_hours:g} h per GPU / {world_size(cfg)}); Young {ckpt.young_minutes:.1f} min, "
            f"Daly {ckpt.daly_minutes:.1f} min, rework bound {ckpt.rework_bound_minutes:.0f} min -> every "
            f"{ckpt.recommended_minutes:.1f} min"
            + (f" (~{ckpt.recommended_steps} steps)" if ckpt.recommended_steps else "")
            + f", {ckpt.overhead:.1%} of the time spent saving"
        )
    print(
        f"\nsearched {result.considered} layouts: {result.valid} valid, {result.fitting} fit; {result.seconds:.2f} s",
        file=sys.stderr,
    )
