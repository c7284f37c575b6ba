"""A layout's parallel dimensions as one value, as torchtitan's ParallelDims
(torchtitan/distributed/parallel_dims.py): each dimension's name, degree and meaning, the world
they multiply into, one label and the parser of its short form (`tp2_pp2_vpp2`).

Code that must treat every dimension alike (labels, overrides, world size) iterates DIMS; a new
dimension is a field and an entry here, plus its physics where it acts (memory, step time) and
the schema field it comes from.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Dim:
    name: str
    meaning: str
    # vpp cuts each pipeline stage's layers into chunks: it adds no ranks
    multiplies_world: bool = True
    # dp replicates the model; the others split it (a layout's complexity counts the splits)
    splits_model: bool = True


# In the order labels list them (as Megatron-LM logs a layout: tensor, pipeline, context, data).
DIMS = (
    Dim("tp", "tensor parallel: each layer's weight matrices split over ranks"),
    Dim("pp", "pipeline parallel: the layers split into stages"),
    Dim("vpp", "virtual pipeline: model chunks per pipeline rank (interleaved 1F1B)", multiplies_world=False),
    Dim("cp", "context parallel: the sequence split over ranks for attention"),
    Dim("dp", "data parallel: replicas, each with a share of the global batch", splits_model=False),
)
_SHORT = re.compile(r"^([a-z]+?)(\d+)$")


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    dp: int = 1

    def __post_init__(self):
        names = [f.name for f in dataclasses.fields(self)]
        if names != [d.name for d in DIMS]:  # one list of dimensions: the fields are DIMS
            raise TypeError(f"ParallelDims fields {names} differ from DIMS {[d.name for d in DIMS]}")

    def items(self) -> list[tuple[str, int]]:
        """(name, degree) of every dimension, in DIMS order."""
        return [(d.name, getattr(self, d.name)) for d in DIMS]

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, d.name) for d in DIMS if d.multiplies_world)

    @property
    def model_parallel_size(self) -> int:
        """Ranks one model replica spans (tp x pp x cp)."""
        return math.prod(getattr(self, d.name) for d in DIMS if d.multiplies_world and d.splits_model)

    @property
    def model_splits(self) -> int:
        """How many ways the model is split (each dimension that does, above 1, counts once)."""
        return sum(getattr(self, d.name) > 1 for d in DIMS if d.splits_model)

    def label(self) -> str:
        """`tp=2 pp=2 vpp=2 cp=1 dp=1`: every dimension, as the planner and the trainer print it."""
        return " ".join(f"{name}={degree}" for name, degree in self.items())

    def short(self) -> str:
        """`tp2_pp2_vpp2`: the dimensions above 1 (`dp1` for a single rank), as --layouts reads them."""
        return "_".join(f"{name}{degree}" for name, degree in self.items() if degree > 1) or "dp1"

    def overrides(self, derived: tuple[str, ...] = ()) -> list[str]:
        """`parallel.NAME=DEGREE` for every dimension but the `derived` ones (dp, which the
        composition derives from the world size): the composition that gives this layout."""
        return [f"parallel.{name}={degree}" for name, degree in self.items() if name not in derived]

    @classmethod
    def parse(cls, text: str) -> ParallelDims:
        """`tp2_pp2_vpp2` -> ParallelDims(tp=2, pp=2, vpp=2); the dimensions not named are 1."""
        return cls(**parse_degrees(text))


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
