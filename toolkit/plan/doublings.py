"""Scaling curves (the guide's method): double one dimension at a time and judge each doubling by
its marginal throughput gain. Ideal is 2x per doubling; practitioners see 1.6-1.8x at scale, so
a doubling under the threshold (default 1.6x) is where adding ranks stops paying.

A scaling run is a sweep directory whose sweep.json carries a "scaling" block
({"dimension": "dp", "mode": "weak" | "strong", "threshold": 1.6}) beside its points.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

DEFAULT_THRESHOLD = 1.6


@dataclass(frozen=True)
class Doubling:
    from_ranks: int
    to_ranks: int
    gain: float  # tokens/s at to_ranks over tokens/s at from_ranks (ideal: to/from)
    efficiency: float  # gain over the ideal gain (of the whole step: a 4x step's ideal is 4x)
    below_threshold: bool

    @property
    def gain_per_doubling(self) -> float:
        """The gain per 2x of ranks: a 4x step that gained g counts as two doublings of sqrt(g)."""
        if self.to_ranks <= self.from_ranks:
            return self.gain
        return self.gain ** (1 / math.log2(self.to_ranks / self.from_ranks))


# A gain equal to the threshold clears it; this much relative slack absorbs float rounding (a 4x
# step of 2.56x is 1.6x per doubling, but 1.6**2 is 2.5600000000000005).
ROUNDING = 1e-9


def doublings(rows: list[dict], threshold: float = DEFAULT_THRESHOLD, key: str = "tokens_per_s") -> list[Doubling]:
    """Successive steps of the curve (points ordered by world size; points without `key` left
    out), each judged against the previous point. The threshold is for a 2x step: a step over
    more than one doubling is judged by its gain per doubling (1.6x per 2x is 2.56x per 4x)."""
    curve = sorted((r for r in rows if r.get(key)), key=lambda r: r["world_size"])
    out = []
    for a, b in zip(curve, curve[1:]):
        ideal = b["world_size"] / a["world_size"]
        gain = b[key] / a[key]
        step = Doubling(a["world_size"], b["world_size"], gain, gain / ideal, False)
        wanted = threshold if ideal > 1 else 1.0
        out.append(dataclasses.replace(step, below_threshold=step.gain_per_doubling < wanted * (1 - ROUNDING)))
    return out


def first_below(steps: list[Doubling]) -> Doubling | None:
    """The first doubling whose marginal gain falls under the threshold: scale no further."""
    return next((s for s in steps if s.below_threshold), None)


def verdict(rows: list[dict], threshold: float = DEFAULT_THRESHOLD, unit: str = "ranks") -> str:
    """One line: the first doubling under the threshold, or that every doubling clears it."""
    below = first_below(doublings(rows, threshold))
    if below is None:
        return f"every doubling gains at least {threshold:g}x per 2x"
    return (
        f"the doubling {below.from_ranks} -> {below.to_ranks} {unit} gains {below.gain:.2f}x, under {threshold:g}x "
        "per 2x"
    )
