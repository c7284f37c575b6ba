"""Layout search: every valid layout for the cluster, those that fit, ranked by throughput.

Enumerates the parallel dimensions the backend trains with, each over its candidate degrees
(DEGREE_OPTIONS: tp powers of two inside a node, pp with even or uneven stage splits, vpp, cp for
long sequences; dp what is left), micro batch, ZeRO stage / distributed optimizer, recompute and
sequence parallel for the configured model, cluster, global batch, precision and backend. Cheap
divisibility checks prune first; every layout that is ranked has passed the same validator as `parakit validate`.
When predicted throughputs tie (within 1%), the simpler layout wins, in the order that changes
training least (toolkit.plan.fit): shard state first, then recompute, and split the model (tp,
pp, cp) last.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import time
from dataclasses import dataclass
from typing import Callable

from toolkit.config.schema import CommConfig, Config, is_moe, moe_layer_pattern
from toolkit.plan.backends import backend_of
from toolkit.plan.layout import Layout, resolve, stage_layer_counts, world_size
from toolkit.plan.memo import searching
from toolkit.plan.memory import GIB, MemoryEstimate, peak_memory, stage_memory
from toolkit.plan.parallel_dims import DIMS, ParallelDims
from toolkit.plan.params import model_params, moe_layer_params
from toolkit.plan.perf import StepEstimate, estimate_step
from toolkit.plan.rules.base import divisors
from toolkit.plan.rules.ranges import ranges
from toolkit.plan.traffic import remedies
from toolkit.plan.validate import is_valid

HEADROOM = 0.10  # keep 10% of device memory free for spikes the estimate does not see
MICRO_BATCHES = (1, 2, 4, 8)
VPPS = (1, 2, 3, 4, 5, 6, 8)
CPS = (1, 2, 4, 8)
RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2}


@dataclass(frozen=True)
class Candidate:
    cfg: Config
    layout: Layout
    memory: MemoryEstimate
    step: StepEstimate

    @property
    def fits_bytes(self) -> float:
        return self.cfg.cluster.gpu_memory_gb * 1e9 * (1 - HEADROOM)

    @property
    def complexity(self) -> tuple:
        """Lower is simpler: model splits last, then recompute, then ZeRO stage."""
        dims = self.layout.dims
        recompute = RECOMPUTE_ORDER[self.cfg.recompute.granularity]
        return dims.model_splits, dims.model_parallel_size, recompute, self.cfg.zero.stage

    def describe(self) -> dict:
        lay, c = self.layout, self.cfg
        return {
            **dict(lay.dims.items()),
            "micro_batch": lay.micro_batch,
            "first_stage_layers": c.parallel.first_stage_layers,
            "last_stage_layers": c.parallel.last_stage_layers,
            "sequence_parallel": c.parallel.sequence_parallel,
            "zero": c.zero.stage,
            "recompute": c.recompute.granularity,
            "memory_gib": self.memory.total / GIB,
            "memory_breakdown_gib": self.memory.as_gib(),
            "bubble": self.step.bubble / self.step.step_time,
            "comm_share": self.step.comm_share,
            "all_to_all_share": self.step.all_to_all_share,
            "step_time_s": self.step.step_time,
            "tokens_per_s": self.step.tokens_per_s,
            "tflops_per_gpu": self.step.tflops_per_gpu,
            "mfu": self.step.mfu,
            "reason": self.reason(),
            "overrides": self.overrides(),
        }

    def overrides(self) -> list[str]:
        """The Hydra overrides that select this layout (for `parakit generate`)."""
        lay, c = self.layout, self.cfg
        out = [
            *lay.dims.overrides(derived=("dp",)),
            f"parallel.sequence_parallel={str(c.parallel.sequence_parallel).lower()}",
            f"train.micro_batch={lay.micro_batch}",
            f"zero={c.zero.stage}",
            f"recompute={c.recompute.granularity}",
        ]
        if c.parallel.first_stage_layers is not None:
            out += [
                f"parallel.first_stage_layers={c.parallel.first_stage_layers}",
                f"parallel.last_stage_layers={c.parallel.last_stage_layers}",
            ]
        return out + self.traffic_settings()

    def traffic_settings(self) -> list[str]:
        """The data-parallel traffic settings (comm.*) this candidate changes from their defaults."""
        default = CommConfig()
        return [
            f"comm.{f.name}={getattr(self.cfg.comm, f.name)}".lower()
            for f in dataclasses.fields(CommConfig)
            if getattr(self.cfg.comm, f.name) != getattr(default, f.name)
        ]

    def reason(self) -> str:
        lay, c, step = self.layout, self.cfg, self.step
        parts = []
        if lay.tp > 1:
            parts.append(
                f"tp={lay.tp} inside the node" if lay.tp <= c.cluster.gpus_per_node else f"tp={lay.tp} across nodes"
            )
        if lay.pp > 1:
            parts.append(
                f"pp={lay.pp}{f' x vpp={lay.vpp}' if lay.vpp > 1 else ''}, bubble {step.bubble / step.step_time:.0%}"
            )
        if lay.cp > 1:
            parts.append(f"cp={lay.cp} for {lay.seq_length}-token sequences")
        if lay.dims.ep > 1:
            whole = " (each expert whole)" if lay.dims.etp == 1 < lay.tp else ""
            parts.append(
                f"ep={lay.dims.ep}: {_experts(c.model.moe.num_experts // lay.dims.ep)} per rank{whole}, "
                f"all-to-all {step.all_to_all_share:.0%}"
            )
        if not parts:
            parts.append("pure data parallel")
        saving = [
            backend_of(c).optimizer_sharding(c.zero.stage),
            "" if c.recompute.granularity == "none" else f"{c.recompute.granularity} recompute",
        ]
        saving = [s for s in saving if s]
        used = self.memory.total / (c.cluster.gpu_memory_gb * 1e9)
        tail = f"{used:.0%} of memory" + (f" with {' + '.join(saving)}" if saving else "")
        comm = f"comm {step.comm_share:.0%}" + (
            f" with {' '.join(self.traffic_settings())}" if self.traffic_settings() else ""
        )
        return "; ".join(parts + [tail, comm])


@dataclass(frozen=True)
class SearchResult:
    ranked: list[Candidate]  # fitting, best first
    considered: int
    valid: int
    fitting: int
    seconds: float
    smallest: Candidate | None  # the least memory of all valid layouts (for "does not fit" reports)


def _tp_options(cfg: Config) -> list[int]:
    m, gpn = cfg.model, cfg.cluster.gpus_per_node
    kv = m.num_kv_heads or m.num_attention_heads
    tps = [2**i for i in range(int(math.log2(gpn)) + 1) if gpn % 2**i == 0]
    return [
        t for t in tps if m.num_attention_heads % t == 0 and (kv % t == 0 or t % kv == 0) and m.ffn_hidden_size % t == 0
    ]


def _stage_splits(num_layers: int, pp: int, vpp: int) -> list[tuple[int | None, int | None]]:
    """(first, last) stage layer counts: the even split, else an uneven one with lighter ends."""
    if stage_layer_counts(num_layers, pp, vpp) is not None:
        return [(None, None)]
    if pp <= 2:
        return []
    per_stage = -(-num_layers // pp)
    per_stage += (-per_stage) % vpp
    edge2 = num_layers - (pp - 2) * per_stage
    if edge2 > 0 and edge2 % 2 == 0 and stage_layer_counts(num_layers, pp, vpp, edge2 // 2, edge2 // 2):
        return [(edge2 // 2, edge2 // 2)]
    return []


def _pp_options(cfg: Config, chosen: dict) -> list[int]:
    world = world_size(cfg) // chosen["tp"]
    return [d for d in range(1, min(world, cfg.model.num_layers) + 1) if world % d == 0]


def _cp_options(cfg: Config, chosen: dict) -> list[int]:
    """Context parallel for long sequences only, each split into 2*cp chunks."""
    seq = cfg.model.seq_length
    return [cp for cp in CPS if cp == 1 or seq % (2 * cp) == 0] if seq >= 8192 else [1]


def _ep_options(cfg: Config, chosen: dict) -> list[int]:
    """Expert parallel for MoE models: the divisors of the experts that divide a stage's ranks."""
    if not is_moe(cfg.model):
        return [1]
    stage_ranks = world_size(cfg) // chosen["pp"]
    return [e for e in divisors(cfg.model.moe.num_experts) if stage_ranks % e == 0]


def _etp_options(cfg: Config, chosen: dict) -> list[int | None]:
    """Each expert split like the dense layers (etp follows tp: unset) or kept whole (etp=1)."""
    if not is_moe(cfg.model) or chosen["tp"] == 1:
        return [None]
    stage_ranks = world_size(cfg) // chosen["pp"]
    return [t for t in (None, 1) if stage_ranks % (chosen["ep"] * (t or chosen["tp"])) == 0]


# Each dimension's degrees worth trying, given those chosen before it (DIMS order); a dimension
# without an entry (or that the backend does not train with) stays at its default, dp is what is left.
DEGREE_OPTIONS: dict[str, Callable[[Config, dict], list[int]]] = {
    "tp": lambda cfg, chosen: _tp_options(cfg),
    "pp": _pp_options,
    "vpp": lambda cfg, chosen: list(VPPS) if chosen["pp"] > 1 else [1],
    "cp": _cp_options,
    "ep": _ep_options,
    "etp": _etp_options,
}


def _degree_choices(cfg: Config, supported, names: list[str], chosen: dict):
    """Every combination of the degrees of `names` (nested in DIMS order, the first outermost)."""
    if not names:
        yield dict(chosen)
        return
    name, rest = names[0], names[1:]
    options = DEGREE_OPTIONS.get(name) if name in supported else None
    # without options, the default: 1, or left unset for one that follows another (etp = tp)
    follows = next(d.follows for d in DIMS if d.name == name)
    for degree in options(cfg, chosen) if options else [None if follows else 1]:
        yield from _degree_choices(cfg, supported, rest, {**chosen, name: degree})


def candidate_configs(cfg: Config):
    """Every layout worth checking, as configurations (cheap divisibility pruning only)."""
    m, t = cfg.model, cfg.train
    world = world_size(cfg)
    backend = backend_of(cfg)
    zeros, recomputes, dims = backend.zero_stages, backend.recompute, backend.parallel_dims
    # Each section made once and shared by the candidates that have it (the ZeRO, recompute and train
    # sections do not depend on the degrees; a layout's parallel section serves its micro batches)
    zero_sections = {
        zero: dataclasses.replace(cfg.zero, stage=zero, offload_optimizer="none", offload_param="none")
        for zero in zeros
    }
    recompute_sections = {
        recompute: dataclasses.replace(cfg.recompute, granularity=recompute, method="uniform", num_layers=1)
        for recompute in recomputes
    }
    train_sections = {micro: dataclasses.replace(t, micro_batch=micro, grad_accum=None) for micro in MICRO_BATCHES}
    # dataclasses.replace(cfg, ...) without its per-call checks: the class called with every field
    changed = ("parallel", "train", "zero", "recompute")
    make = type(cfg)
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init and f.name not in changed}
    for degrees in _degree_choices(cfg, dims, [d.name for d in DIMS if d.name != "dp"], {}):
        model_parallel = ParallelDims(**degrees).model_parallel_size
        tp, pp = degrees["tp"], degrees["pp"]
        if world % model_parallel:
            continue
        for first, last in _stage_splits(m.num_layers, pp, degrees["vpp"]):
            if first is not None and not backend.uneven_pipeline_stages:
                continue
            dp = world // model_parallel
            parallel = dataclasses.replace(
                cfg.parallel,
                **degrees,
                dp=None,
                sequence_parallel="sp" in dims and tp > 1,
                tp_comm_overlap=cfg.parallel.tp_comm_overlap and tp > 1,
                first_stage_layers=first,
                last_stage_layers=last,
            )
            for micro in MICRO_BATCHES:
                if t.global_batch % (micro * dp):
                    continue
                accum = t.global_batch // (micro * dp)
                if degrees["vpp"] > 1 and accum % pp:
                    continue
                for zero, recompute in itertools.product(zeros, recomputes):
                    if pp > 1 and zero not in backend.pipeline_zero_stages:
                        continue
                    yield make(
                        **sections,
                        parallel=parallel,
                        train=train_sections[micro],
                        zero=zero_sections[zero],
                        recompute=recompute_sections[recompute],
                    )


def search(cfg: Config) -> SearchResult:
    """Every candidate layout of `cfg` that validates and fits, best first (see the module's docstring).
    The candidates share most of their sections and each layout's stages: while it runs, what
    depends only on those is computed once (toolkit.plan.memo)."""
    with searching():
        return _search(cfg)


# The fields the search chooses; a range error anywhere else holds for every candidate.
SEARCHED = ("parallel.", "train.micro_batch", "train.grad_accum", "zero.", "recompute.")


def unsearchable(cfg: Config) -> bool:
    """A value out of its bounds that the search does not choose (e.g. a cluster file's
    gpus_per_node=0 or gpu_memory_gb=null): no candidate can be made or valid."""
    return any(not any(f.startswith(SEARCHED) for f in e.fields) for e in ranges(cfg))


def _search(cfg: Config) -> SearchResult:
    start = time.perf_counter()
    considered = valid = 0
    fitting: list[Candidate] = []
    smallest = None
    if unsearchable(cfg):
        return SearchResult(fitting, considered, valid, 0, time.perf_counter() - start, smallest)
    capacity = cfg.cluster.gpu_memory_gb * 1e9 * (1 - HEADROOM)
    layout_of = _resolver()
    for candidate_cfg in candidate_configs(cfg):
        considered += 1
        layout = layout_of(candidate_cfg)
        if smallest is not None:  # the first stage's memory is at most the peak (peak_memory weighs it):
            # a candidate whose first stage is over the device and the smallest already is skipped as well
            first = stage_memory(candidate_cfg, layout, 0).total
            if first > capacity and first >= smallest.memory.total:
                continue
        memory = peak_memory(candidate_cfg, layout)
        if memory.total > capacity and smallest is not None and memory.total >= smallest.memory.total:
            continue  # neither fits nor beats the smallest seen: skip the costly part
        if not is_valid(candidate_cfg, data=False):  # a layout does not depend on the data
            continue
        valid += 1
        candidate = Candidate(candidate_cfg, layout, memory, estimate_step(candidate_cfg, layout))
        if smallest is None or memory.total < smallest.memory.total:
            smallest = candidate
        if memory.total <= capacity:
            fitting.append(candidate)
    # Rank by throughput in 1% buckets, the simpler layout first inside a bucket.
    fitting.sort(key=_rank)
    fits = len(fitting)
    fitting = sorted(fitting + _with_traffic_settings(fitting[:TRAFFIC_TRIED], capacity), key=_rank)
    return SearchResult(fitting, considered, valid, fits, time.perf_counter() - start, smallest)


# What a Layout does not depend on (toolkit.plan.layout.resolve reads neither): the candidates that
# differ only in these share one resolved layout.
LAYOUT_FREE = ("zero", "recompute")


def _resolver() -> Callable[[Config], Layout]:
    """resolve, computed once for consecutive candidates that differ only in LAYOUT_FREE sections
    (candidate_configs yields each layout's ZeRO stages and recomputes in a row, sharing the other
    sections)."""
    sections = operator.attrgetter(*(f.name for f in dataclasses.fields(Config) if f.name not in LAYOUT_FREE))
    last_ids, last = None, None

    def layout_of(cfg: Config) -> Layout:
        nonlocal last_ids, last
        read = sections(cfg)
        ids = tuple(map(id, read))
        if ids != last_ids:
            last_ids, last = ids, (read, resolve(cfg))  # the sections held: their ids stay theirs
        return last[1]

    return layout_of


def _rank(c: Candidate) -> tuple:
    return -math.floor(math.log(c.step.tokens_per_s) / math.log(1.01)), c.complexity


# The leading layouts are tried again with each data-parallel traffic setting (comm.*) that changes
# no number the training computes (hierarchical arrangements; not the quantized or 16-bit
# reductions, which `parakit plan` offers for the configured layout instead).
TRAFFIC_TRIED = 10


def _with_traffic_settings(leading: list[Candidate], capacity: float) -> list[Candidate]:
    """Each leading layout's fastest variant with a comm.* setting alone, where one fits."""
    out = []
    for c in leading:
        for remedy in remedies(c.cfg, c.layout, c.step, same_numerics=True):
            if all(o.startswith("comm.") for o in remedy.overrides) and remedy.memory.total <= capacity:
                out.append(Candidate(remedy.cfg, remedy.layout, remedy.memory, remedy.step))
                break
    return out


def decision_path(cfg: Config, result: SearchResult) -> list[str]:
    """The practitioner's path for this model (fits on one GPU -> data parallel; in one node -> tensor
    parallel inside it; else pipeline stages across nodes), and where the top layout departs from it."""
    gpn, world = cfg.cluster.gpus_per_node, world_size(cfg)
    fitting = result.ranked
    dp_only = [c for c in fitting if c.layout.tp == c.layout.pp == c.layout.cp == c.layout.dims.ep == 1]
    in_node = [c for c in fitting if c.layout.pp == 1 and c.layout.cp == 1 and c.layout.tp <= gpn]
    lines = []
    if dp_only:
        lines.append(f"fits on one GPU (with {_savings(dp_only[0])}) -> data parallel over all {world} GPUs")
        path = dp_only
    elif in_node:
        lines.append(
            "does not fit on one GPU even with ZeRO and recompute; fits in one node -> tensor parallel inside the "
            f"node (tp<={gpn})"
        )
        path = in_node
    else:
        lines.append("does not fit in one node -> tensor parallel inside the node, pipeline stages across nodes")
        path = fitting
    if not fitting:
        lines.append(
            "no layout fits: add GPUs, lower train.micro_batch is already 1, or use a lower precision / ZeRO-3 offload"
        )
        return lines
    top, simple = fitting[0], path[0]
    if top is simple:
        lines.append("the top layout follows this path")
    else:
        gain = top.step.tokens_per_s / simple.step.tokens_per_s - 1
        why = []
        if simple.step.comm_share > top.step.comm_share + 0.05:
            why.append(f"spends {simple.step.comm_share:.0%} of its step communicating (vs {top.step.comm_share:.0%})")
        if (
            simple.layout.pp > 1
            and simple.step.bubble / simple.step.step_time > top.step.bubble / top.step.step_time + 0.02
        ):
            why.append(f"idles {simple.step.bubble / simple.step.step_time:.0%} of its step in the bubble")
        if RECOMPUTE_ORDER[simple.cfg.recompute.granularity] > RECOMPUTE_ORDER[top.cfg.recompute.granularity]:
            why.append(f"needs {simple.cfg.recompute.granularity} recompute to fit")
        lines.append(
            f"the top layout departs from it ({_shape(top)} instead of {_shape(simple)}): {gain:+.0%} throughput"
            + (f", because the path's layout {' and '.join(why)}" if why else "")
        )
    if is_moe(cfg.model):
        lines.append(_experts_line(cfg, fitting))
    return lines


def _experts_line(cfg: Config, fitting: list[Candidate]) -> str:
    """Whether expert parallel is the answer for a mixture of experts: the top layout against the
    best without it (the experts' weights otherwise replicate on every data-parallel rank)."""
    top = fitting[0]
    without = next((c for c in fitting if c.layout.dims.ep == 1), None)
    share = f"{params_share(cfg):.0%} of the weights are experts"
    if top.layout.dims.ep == 1:
        spread = next((c for c in fitting if c.layout.dims.ep > 1), None)
        slower = 1 - spread.step.tokens_per_s / top.step.tokens_per_s if spread else 0.0
        cost = f"; the best with it ({_shape(spread)}) is {slower:.0%} slower" if spread else ""
        return f"mixture of experts ({share}): expert parallel does not pay here{cost}"
    ep = top.layout.dims.ep
    per_rank = _experts(cfg.model.moe.num_experts // ep)
    head = f"mixture of experts ({share}) -> expert parallel: ep={ep} spreads them, {per_rank} per rank"
    if without is None:
        return head + "; no layout without it fits"
    gain = top.step.tokens_per_s / without.step.tokens_per_s - 1
    return head + f"; {gain:+.0%} throughput over the best layout without it ({_shape(without)})"


def params_share(cfg: Config) -> float:
    """The share of the model's parameters that are routed experts."""
    experts = sum(moe_layer_pattern(cfg.model)) * moe_layer_params(cfg.model, etp=1)[1]
    return experts / model_params(cfg.model)


def _shape(c: Candidate) -> str:
    return c.layout.dims.label()


def _savings(c: Candidate) -> str:
    parts = [f"zero={c.cfg.zero.stage}", f"recompute={c.cfg.recompute.granularity}"]
    return ", ".join(parts)


def _experts(count: int) -> str:
    return f"{count} expert{'s' * (count != 1)}"
