"""Planner vs published training runs: predicted throughput beside the published figure.

    python scripts/bench_planner.py [--runs scripts/data/published_runs.yaml] [--json OUT]

Each run in the data file is composed into a parakit configuration (its model, cluster, layout,
batch, precision, recompute), the planner predicts its step time, and the prediction is turned
into the metric the source published (step time, tokens/s per GPU, or TFLOP/s per GPU counted
with the source's own FLOP convention). Where the source leaves the micro batch or interleaving
open, the planner's own best choice that fits in memory is used (listed under "chosen").
A run's `overrides` are further stated settings as Hydra overrides (the software's defaults of
the time, a cluster's stated network or memory); `schedule.vpp` prices an interleaving the
source states but parakit's configuration cannot express, `kernels` the element-wise and loss
kernels of another backend (a run whose sharding parakit models as DeepSpeed's ZeRO-3 but whose
kernels were fused: Transformer Engine's, or torch.compile's).
The goal is +-15% on every run; the summary says how many meet it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

import yaml

from toolkit.config.schema import head_dim
from toolkit.config.store import compose_config
from toolkit.plan.backends import backend_named, backend_of
from toolkit.plan.flops import step_flops
from toolkit.plan.layout import bubble_fraction, resolve
from toolkit.plan.memory import GIB, peak_memory
from toolkit.plan.params import model_params
from toolkit.plan.perf import estimate_step
from toolkit.plan.validate import validate

DATA = Path(__file__).parent / "data" / "published_runs.yaml"
TOLERANCE = 0.15


def convention_flops(convention: str, m, seq: int, global_batch: int, vocab: int) -> float:
    """FLOPs per step as the source counts them (see the data file's header)."""
    tokens = global_batch * seq
    if convention == "narayanan":  # 96 B s l h^2 (1 + s/6h + V/16lh): always counts full recompute
        return step_flops(m, seq, global_batch, "full", vocab, causal=False).hardware
    if convention == "noncausal":
        return step_flops(m, seq, global_batch, "none", vocab, causal=False).model
    if convention == "palm":  # 6N + 12 L H Q T per token
        return tokens * (6 * model_params(m) + 12 * m.num_layers * m.num_attention_heads * head_dim(m) * seq)
    if convention == "bloom":
        return 8 * model_params(m) * tokens
    raise ValueError(f"unknown FLOP convention {convention!r}")


def compose_run(run: dict):
    overrides = [
        f"model={run['base']}",
        f"cluster={run['cluster']}",
        f"recompute={run['recompute']}",
        f"precision={run['precision']}",
        f"backend={run.get('backend', 'megatron')}",
        f"zero={run['zero']}",
        "train.steps=1",
        "optim.warmup_steps=0",
        "train.kernels=reference",  # the runs' own kernels are their backend's, or those `kernels` names
        *run.get("overrides", []),  # further stated settings, as Hydra overrides (zero.overlap_comm=false)
    ]
    cfg = compose_config(overrides)
    gpus_per_node = cfg.cluster.gpus_per_node
    model = dataclasses.replace(cfg.model, **run.get("model", {}))
    model = dataclasses.replace(model, max_position_embeddings=max(model.max_position_embeddings, model.seq_length))
    parallel = dataclasses.replace(cfg.parallel, **run["parallel"])
    train = dataclasses.replace(cfg.train, **run["train"])
    cluster = dataclasses.replace(
        cfg.cluster, nodes=max(1, run["gpus"] // gpus_per_node), gpus_per_node=min(gpus_per_node, run["gpus"])
    )
    return dataclasses.replace(cfg, model=model, parallel=parallel, train=train, cluster=cluster)


def _choices(cfg, run: dict):
    """The configuration, or one per open choice (micro batch, interleaving) the source leaves out."""
    dp = cfg.cluster.nodes * cfg.cluster.gpus_per_node // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
    micros = [run["train"]["micro_batch"]] if "micro_batch" in run["train"] else [1, 2, 4, 8, 16]
    vpps = [cfg.parallel.vpp] if ("vpp" in run["parallel"] or cfg.parallel.pp == 1) else range(1, 9)
    for micro in micros:
        if cfg.train.global_batch % (micro * dp):
            continue
        for vpp in vpps:
            candidate = dataclasses.replace(
                cfg,
                train=dataclasses.replace(cfg.train, micro_batch=micro),
                parallel=dataclasses.replace(cfg.parallel, vpp=vpp),
            )
            errors = {e.rule for e in validate(candidate, data=False).errors}  # the layout, not the data
            if errors & {"pp_layers", "pp_uneven", "vpp_microbatches", "batch_split", "world_size"}:
                continue
            yield candidate, errors


def _scheduled(layout, run: dict):
    """The layout with the source's interleaving where parakit cannot configure it (`schedule.vpp`:
    Llama 3's chunks of one layer beside an embedding-only first and a loss-only last chunk, which
    megatron-core expresses with account_for_embedding/loss_in_pipeline_split): priced as is."""
    vpp = run.get("schedule", {}).get("vpp")
    if not vpp:
        return layout
    return dataclasses.replace(
        layout,
        dims=layout.dims.replace(vpp=vpp),
        bubble_fraction=bubble_fraction(layout.pp, vpp, layout.num_microbatches),
    )


def _kernels(cfg, run: dict):
    """The backend description to price the run with: its own, or with the element-wise and loss
    kernels of the backend `kernels` names."""
    backend = backend_of(cfg)
    if "kernels" not in run:
        return backend
    fused = backend_named(run["kernels"])
    return dataclasses.replace(
        backend,
        eager_layers=fused.eager_layers,
        layer_dispatches=fused.layer_dispatches,
        loss_logit_passes=fused.loss_logit_passes,
        loss_fresh_logits=fused.loss_fresh_logits,
    )


def predict(run: dict) -> dict:
    cfg = compose_run(run)
    backend = _kernels(cfg, run)
    best = None
    for candidate, errors in _choices(cfg, run):
        layout = _scheduled(resolve(candidate), run)
        step = estimate_step(candidate, layout, backend)
        memory = peak_memory(candidate, layout)
        fits = memory.total <= candidate.cluster.gpu_memory_gb * 1e9
        key = (fits, -step.step_time)
        if best is None or key > best[0]:
            best = (key, candidate, layout, step, memory, errors)
    if best is None:
        raise ValueError(f"{run['id']}: no micro batch / interleaving splits this layout")
    _, cfg, layout, step, memory, errors = best
    published = run["published"]
    metric, value = next(iter(published.items()))
    seq, gpus = layout.seq_length, layout.world_size
    if metric == "step_time_s":
        predicted = step.step_time
    elif metric == "tokens_per_s_per_gpu":
        predicted = layout.global_batch * seq / step.step_time / gpus
    elif metric == "tflops_per_gpu":
        flops = convention_flops(run["convention"], cfg.model, seq, layout.global_batch, layout.padded_vocab_size)
        predicted = flops / step.step_time / gpus / 1e12
    else:
        raise ValueError(f"{run['id']}: unknown metric {metric}")
    chosen = []
    if "micro_batch" not in run["train"]:
        chosen.append(f"micro {layout.micro_batch}")
    if "vpp" not in run["parallel"] and "schedule" not in run and layout.pp > 1:
        chosen.append(f"vpp {layout.vpp}")
    return {
        "id": run["id"],
        "gpus": gpus,
        "layout": layout.dims.label().replace("=", ""),  # tp4 pp8 vpp8 cp2 dp8 (ep8 where experts split)
        # error > 0: the planner predicts more throughput (a shorter step) than was measured
        "metric": metric,
        "published": value,
        "predicted": predicted,
        "error": value / predicted - 1 if metric == "step_time_s" else predicted / value - 1,
        "mfu": step.mfu,
        "bubble": step.bubble / step.step_time,
        "comm": step.comm_share,
        "memory_gib": memory.total / GIB,
        "chosen": chosen,
        "validator": sorted(errors),
        "assumed": run.get("assumed", []),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=DATA)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()
    data = yaml.safe_load(args.runs.read_text())
    rows = [predict(run) for run in data["runs"]]

    short = {"step_time_s": "step s", "tokens_per_s_per_gpu": "tok/s/GPU", "tflops_per_gpu": "TFLOP/s/GPU"}
    print(
        f"{'run':34} {'GPUs':>6} {'layout':28} {'metric':11} {'published':>10} {'predicted':>10} {'error':>7}  "
        f"{'MFU':>5} {'bubble':>6} {'comm':>5} {'mem GiB':>7}  chosen / validator"
    )
    for r in rows:
        flag = " " if abs(r["error"]) <= TOLERANCE else "*"
        notes = ", ".join(r["chosen"] + [f"validator: {v}" for v in r["validator"]])
        print(
            f"{r['id']:34} {r['gpus']:>6} {r['layout']:28} {short[r['metric']]:11} {r['published']:>10.4g} "
            f"{r['predicted']:>10.4g} {r['error']:>+6.1%}{flag} {r['mfu']:>5.1%} {r['bubble']:>6.1%} {r['comm']:>5.1%} "
            f"{r['memory_gib']:>7.1f}  {notes}"
        )
    errors = [abs(r["error"]) for r in rows]
    within = sum(e <= TOLERANCE for e in errors)
    print(
        f"\n{within} of {len(rows)} runs within +-{TOLERANCE:.0%}; median |error| {statistics.median(errors):.1%}, "
        f"mean |error| {statistics.fmean(errors):.1%}, worst {max(errors):.1%} "
        f"(geometric mean ratio {math.exp(statistics.fmean(math.log(1 + r['error']) for r in rows)):.3f})"
    )
    for excluded in data.get("excluded", []):
        print(f"excluded {excluded['id']}: {excluded['why']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
