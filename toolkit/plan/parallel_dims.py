"""A layout's parallel dimensions as one value, as torchtitan's ParallelDims
(torchtitan/distributed/parallel_dims.py): each dimension's name, degree and meaning, the world
they multiply into, one label and the parser of its short form (`tp2_pp2_vpp2`).

Code that must treat every dimension alike (labels, overrides, world size, sweep and report
columns, the validator's world-size and backend-support rules) iterates DIMS; a new dimension is
an entry here and its field in the schema (toolkit.config.schema.ParallelConfig, with its bounds),
plus its physics where it acts (memory, step time), what the emitters pass upstream, and which
backends train with it (toolkit.plan.backends, parallel_dims). Sequence parallel is an option of
tp, not a degree.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from toolkit.plan.memo import during_search


@dataclass(frozen=True)
class Dim:
    name: str
    meaning: str
    # vpp cuts each pipeline stage's layers into chunks: it adds no ranks
    multiplies_world: bool = True
    # dp replicates the model; the others split it (a layout's complexity counts the splits)
    splits_model: bool = True
    # megatron-core's name for the degree: a ModelParallelConfig field and the keyword of
    # parallel_state.initialize_model_parallel (megatron/core/model_parallel_config.py); None where
    # megatron-core derives it (dp: the ranks left over)
    megatron: str | None = None
    # megatron-core takes None, not 1, for "not used" (the virtual pipeline: no interleaving)
    none_at_one: bool = False
    # how far raising this degree is tried when a layout does not fit (toolkit.plan.fit): "node"
    # (tensor parallel stays inside a node: its all-reduces every layer need NVLink), "world", or
    # None when a higher degree frees no weight memory (vpp, cp: cp splits only activations)
    fit_reach: str | None = None
    # an earlier dimension whose degree it takes when a configuration leaves it unset (etp follows
    # tp, as megatron-core's expert_tensor_parallel_size); None: 1 when unset
    follows: str | None = None
    # labels and short forms leave it out at its default (a dense layout's label stays tp..dp)
    quiet: bool = False

    def megatron_degree(self, degree: int) -> int | None:
        return None if self.none_at_one and degree == 1 else degree


# The registry of dimensions, in the order labels list them (as Megatron-LM logs a layout:
# tensor, pipeline, context, data). Everything that treats the dimensions alike reads it when it
# runs, so that an entry added here (with its schema field) is labelled, parsed, swept, reported
# and range-checked without another change (tests/test_parallel_dims.py adds one).
DIMS: list[Dim] = [
    Dim(
        "tp",
        "tensor parallel: each layer's weight matrices split over ranks",
        megatron="tensor_model_parallel_size",
        fit_reach="node",
    ),
    Dim(
        "pp",
        "pipeline parallel: the layers split into stages",
        megatron="pipeline_model_parallel_size",
        fit_reach="world",
    ),
    Dim(
        "vpp",
        "virtual pipeline: model chunks per pipeline rank (interleaved 1F1B)",
        multiplies_world=False,
        megatron="virtual_pipeline_model_parallel_size",
        none_at_one=True,
    ),
    Dim("cp", "context parallel: the sequence split over ranks for attention", megatron="context_parallel_size"),
    Dim("dp", "data parallel: replicas, each with a share of the global batch", splits_model=False),
    # The experts fold into the ranks attention uses (megatron-core parallel_state, "MoE parallel
    # folding", Liu et al. 2025, arXiv 2504.14960): etp x ep x expert-dp = tp x cp x dp, so neither
    # adds ranks.
    Dim(
        "ep",
        "expert parallel: each MoE layer's experts split over ranks",
        multiplies_world=False,
        megatron="expert_model_parallel_size",
        fit_reach="world",
        quiet=True,
    ),
    Dim(
        "etp",
        "expert tensor parallel: each expert's matrices split over ranks",
        multiplies_world=False,
        megatron="expert_tensor_parallel_size",
        follows="tp",
        quiet=True,
    ),
]
# How the ranks are numbered, innermost first, as megatron-core's default
# (parallel_state.initialize_model_parallel, order="tp-cp-ep-dp-pp"): consecutive ranks form a
# tensor-parallel group, then context, data and pipeline groups over ever larger strides. vpp
# adds no ranks. A dimension that multiplies the world takes its place here.
RANK_ORDER = ("tp", "cp", "dp", "pp")
# The experts' ranks are numbered over the same ranks in their own order
# (parallel_state.initialize_model_parallel's expert_decoder_rank_generator: "tp-ep-dp-pp" with
# etp for tp and the expert-data-parallel degree for dp).
EXPERT_RANK_ORDER = ("etp", "ep", "edp", "pp")
_SHORT = re.compile(r"^([a-z]+?)(\d+)$")


def _rebuilt(degrees: dict) -> ParallelDims:  # unpickling and copying
    return ParallelDims(**degrees)


class ParallelDims:
    """The degree of every dimension of DIMS (1 where not given), read as attributes (`dims.tp`).
    Immutable and hashable; built from DIMS when created, so a dimension added there is carried
    everywhere a layout goes."""

    def __init__(self, **degrees: int):
        names = [d.name for d in DIMS]
        if not degrees.keys() <= set(names):
            unknown = sorted(set(degrees) - set(names))
            raise TypeError(f"no parallel dimension {', '.join(unknown)} (the dimensions: {', '.join(names)})")
        resolved: dict[str, int] = {}
        for dim in DIMS:  # None or absent: 1, or the degree of the dimension it follows
            given = degrees.get(dim.name)
            resolved[dim.name] = int(resolved.get(dim.follows, 1) if given is None else given)
        # each degree an attribute of the instance too (`dims.tp` read without a call: the layout
        # search reads them a few hundred thousand times)
        self.__dict__.update(resolved, _degrees=tuple(resolved.items()))

    @classmethod
    def of(cls, parallel, dp: int) -> ParallelDims:
        """The degrees a configuration's `parallel` section gives (its fields are named as DIMS),
        with dp resolved (the section may leave it to the world size)."""
        return _of(cls, parallel, dp)

    def replace(self, **degrees: int) -> ParallelDims:
        """These degrees changed, the others kept (as dataclasses.replace)."""
        return ParallelDims(**{**dict(self._degrees), **degrees})

    def __getattr__(self, name: str) -> int:  # only for a name that is not a degree's
        raise AttributeError(f"no parallel dimension {name!r}")

    def __setattr__(self, name, value):
        raise AttributeError("ParallelDims is immutable")

    def __eq__(self, other) -> bool:
        return isinstance(other, ParallelDims) and self._degrees == other._degrees

    def __hash__(self) -> int:
        return hash(self._degrees)

    def __reduce__(self):
        return _rebuilt, (dict(self._degrees),)

    def __repr__(self) -> str:
        return f"ParallelDims({', '.join(f'{n}={d}' for n, d in self._degrees)})"

    def items(self) -> list[tuple[str, int]]:
        """(name, degree) of every dimension, in DIMS order."""
        return list(self._degrees)

    def at_default(self, dim: Dim) -> bool:
        """Whether `dim` has the degree a configuration that leaves it unset gets."""
        return getattr(self, dim.name) == (getattr(self, dim.follows) if dim.follows else 1)

    def hidden(self, dim: Dim) -> bool:
        """Whether labels, overrides and the count of splits leave `dim` out: a quiet dimension at its
        default (ep=1, or etp following tp)."""
        return dim.quiet and self.at_default(dim)

    def _shown(self) -> list[tuple[str, int]]:
        return [(d.name, getattr(self, d.name)) for d in DIMS if not self.hidden(d)]

    @property
    def edp(self) -> int:
        """Expert data parallel: the replicas of each expert, tp x cp x dp / (etp x ep)."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, d.name) for d in DIMS if d.multiplies_world)

    def stride(self, name: str) -> int:
        """How far apart the ranks of one `name` group are: the product of the degrees numbered
        inside it (RANK_ORDER, or EXPERT_RANK_ORDER for the experts' etp, ep and edp). A group of
        the cp x dp ranks starts at cp's stride."""
        order = RANK_ORDER if name in RANK_ORDER else EXPERT_RANK_ORDER
        inner = order[: order.index(name)]
        return math.prod(getattr(self, n) for n in inner)

    @property
    def model_parallel_size(self) -> int:
        """Ranks one model replica spans (tp x pp x cp)."""
        return math.prod(getattr(self, d.name) for d in DIMS if d.multiplies_world and d.splits_model)

    @property
    def model_splits(self) -> int:
        """How many ways the model is split (each dimension that does, above 1, counts once; one
        that follows another at its default, etp = tp, does not count again)."""
        return sum(getattr(self, d.name) > 1 for d in DIMS if d.splits_model and not self.hidden(d))

    def label(self) -> str:
        """`tp=2 pp=2 vpp=2 cp=1 dp=1`: every dimension (the quiet ones, ep and etp, where not at
        their default), as the planner and the trainer print it."""
        return " ".join(f"{name}={degree}" for name, degree in self._shown())

    def short(self) -> str:
        """`tp2_pp2_vpp2`: the dimensions not at their default (`dp1` for a single rank), as --layouts
        reads them."""
        changed = [(d.name, getattr(self, d.name)) for d in DIMS if not self.at_default(d)]
        return "_".join(f"{name}{degree}" for name, degree in changed) or "dp1"

    def overrides(self, derived: tuple[str, ...] = ()) -> list[str]:
        """`parallel.NAME=DEGREE` for every dimension but the `derived` ones (dp, which the
        composition derives from the world size) and the quiet ones at their default (left unset, they
        get it): the composition that gives this layout."""
        return [f"parallel.{name}={degree}" for name, degree in self._shown() if name not in derived]

    @classmethod
    def parse(cls, text: str) -> ParallelDims:
        """`tp2_pp2_vpp2` -> ParallelDims(tp=2, pp=2, vpp=2); the dimensions not named are 1."""
        return cls(**parse_degrees(text))


@during_search(by_identity=2)  # the search's rules and layouts read each candidate's section several times
def _of(cls: type[ParallelDims], parallel, dp: int) -> ParallelDims:
    return cls(**{d.name: getattr(parallel, d.name) for d in DIMS if d.name != "dp"}, dp=dp)


def parse_degrees(text: str) -> dict[str, int]:
    """`tp2_pp2_vpp2` -> {"tp": 2, "pp": 2, "vpp": 2}: the degrees named, joined by `_`, each at
    least 1 and a dimension at most once. ValueError names the part that is not."""
    names = [d.name for d in DIMS]
    degrees: dict[str, int] = {}
    for part in text.split("_"):
        match = _SHORT.match(part)
        if not match or match.group(1) not in names or int(match.group(2)) < 1:
            raise ValueError(f"{part!r} is not a size; write {', '.join(f'{n}N' for n in names)} joined by _")
        if match.group(1) in degrees:
            raise ValueError(f"gives {match.group(1)} twice")
        degrees[match.group(1)] = int(match.group(2))
    return degrees
