"""The layout search's speed against its goals, and a fingerprint of what it ranks (issue 42 item 4).

    python scripts/bench_search.py [--runs N] [--json OUT]
    python scripts/bench_search.py --dump OUT          # every ranked candidate's figures, full precision
    python scripts/bench_search.py --compare A B       # two dumps agree to 1e-9 relative

Timed in one invocation: the 70B search in-process (`SearchResult.seconds` of
`plan model=llama3_70b cluster=h100_cluster cluster.nodes=8 train.global_batch=512`, the median of N
after a warm-up), the whole 405B command in a fresh process (`parakit plan model=llama3_405b
cluster=h100_cluster cluster.nodes=2048 train.global_batch=2048`, 16,384 H100s: wall time, the
median of N), and a fixed reference workload (pure Python of a known size: attribute reads, float
arithmetic and calls, as the search does). Each figure is printed against its goal (0.6 s and
1.0 s on a 2-core machine) and as a multiple of the reference, so that a run on a busy or a
different machine can be judged by the ratio.

Before and after a change: run it in the tree before the change (a copy of toolkit/ on PYTHONPATH,
run from outside the checkout) and after, and compare `--dump`s: they must agree (`--compare`).

The top-10 hash fingerprints the ranking: each of the top 10 layouts' dims label, micro batch,
ZeRO stage, recompute, the rest of the settings that select it (sequence parallel, uneven stages,
comm.*), and its predicted step time (12 significant digits). The same physics must give the same
hash before and after a change that only makes the search faster.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from toolkit.config.store import compose_config
from toolkit.plan.search import Candidate, SearchResult, search

GOAL_SEARCH_S = 0.6
GOAL_COMMAND_S = 1.0
SEARCH_70B = ["model=llama3_70b", "cluster=h100_cluster", "cluster.nodes=8", "train.global_batch=512"]
COMMAND_405B = ["plan", "model=llama3_405b", "cluster=h100_cluster", "cluster.nodes=2048", "train.global_batch=2048"]
# What --dump records: dense and MoE models, megatron and deepspeed, GPU and CPU clusters.
DUMPED = {
    "llama3_70b_64xh100": SEARCH_70B,
    "llama3_405b_16384xh100": COMMAND_405B[1:],
    "llama3_405b_recipe": ["recipe=llama3_405b_16384xh100"],
    "llama3_8b_8xh100": ["model=llama3_8b", "cluster=8xh100", "train.global_batch=256", "train=pretrain"],
    "mixtral_8x7b_64xh100": ["model=mixtral_8x7b", "cluster=h100_cluster", "train.global_batch=256"],
    "gpt3_175b_a100_deepspeed": [
        "model=gpt3_175b",
        "cluster=a100_cluster",
        "cluster.nodes=16",
        "train.global_batch=512",
        "backend=deepspeed",
    ],
    "tiny_cpu": ["model=tiny", "train.global_batch=16"],
}
REFERENCE_LOOPS = 200_000


@dataclass(frozen=True)
class _Point:
    x: float
    y: float


def reference_workload() -> float:
    """Seconds of a fixed pure-Python workload (the same work every run and every version)."""
    start = time.perf_counter()
    total, point = 0.0, _Point(1.5, 2.5)
    for i in range(REFERENCE_LOOPS):
        point = _Point(point.y, (point.x * 1.000001 + i % 7) / 1.5)
        total += _step(point, i)
    assert math.isfinite(total)
    return time.perf_counter() - start


def _step(p: _Point, i: int) -> float:
    return max(p.x, p.y) / (1 + (i & 3))


def _key(c: Candidate) -> list:
    return [c.layout.dims.label(), c.layout.micro_batch, c.cfg.zero.stage, str(c.cfg.recompute.granularity)]


def top_hash(result: SearchResult, top: int = 10) -> str:
    """sha256 (first 16 hex digits) of the top layouts: what selects each and its predicted step time."""
    rows = [_key(c) + c.overrides() + [f"{c.step.step_time:.12g}"] for c in result.ranked[:top]]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def time_search(overrides: list[str], runs: int) -> tuple[float, SearchResult]:
    cfg = compose_config(overrides)
    search(cfg)  # warm-up: imports, first-call caches
    results = [search(cfg) for _ in range(runs)]
    return statistics.median(r.seconds for r in results), results[-1]


def _parakit() -> list[str]:
    script = Path(sys.executable).parent / "parakit"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from toolkit.cli import main; sys.exit(main())"]


def time_command(args: list[str], runs: int) -> float:
    times = []
    for _ in range(runs + 1):  # the first warms the disk cache and is not counted
        start = time.perf_counter()
        subprocess.run([*_parakit(), *args], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def bench(runs: int) -> dict:
    reference = statistics.median(reference_workload() for _ in range(max(runs, 3)))
    search_s, result = time_search(SEARCH_70B, runs)
    command_s = time_command(COMMAND_405B, runs)
    search_405b_s, result_405b = time_search(COMMAND_405B[1:], runs)
    return {
        "reference_s": reference,
        "search_70b": {
            "overrides": SEARCH_70B,
            "seconds": search_s,
            "goal_s": GOAL_SEARCH_S,
            "over_reference": search_s / reference,
            "considered": result.considered,
            "valid": result.valid,
            "fitting": result.fitting,
            "top10_hash": top_hash(result),
        },
        "command_405b": {
            "command": ["parakit", *COMMAND_405B],
            "seconds": command_s,
            "goal_s": GOAL_COMMAND_S,
            "over_reference": command_s / reference,
            "search_seconds": search_405b_s,  # its search alone, in-process (as the 70B one)
            "considered": result_405b.considered,
            "top10_hash": top_hash(result_405b),
        },
        "runs": runs,
    }


def dump(path: Path) -> None:
    """Every ranked candidate (and the smallest) of each DUMPED search, with full-precision figures."""
    out = {}
    for name, overrides in DUMPED.items():
        result = search(compose_config(overrides))
        rows = [_key(c) + c.overrides() + [c.step.step_time, c.memory.total] for c in result.ranked]
        smallest = result.smallest
        out[name] = {
            "counts": [result.considered, result.valid, result.fitting],
            "ranked": rows,
            "smallest": _key(smallest) + smallest.overrides() + [smallest.memory.total] if smallest else None,
        }
    path.write_text(json.dumps(out, indent=1))


def compare(a: Path, b: Path, rel: float = 1e-9) -> int:
    """0 when both dumps rank the same candidates in the same order with figures within `rel`."""
    left, right = json.loads(a.read_text()), json.loads(b.read_text())
    bad = 0
    for name in sorted(set(left) | set(right)):
        x, y = left.get(name), right.get(name)
        if x is None or y is None:
            print(f"{name}: only in {'the second' if x is None else 'the first'}")
            bad += 1
            continue
        problems = [] if x["counts"] == y["counts"] else [f"counts {x['counts']} vs {y['counts']}"]
        for i, (p, q) in enumerate(zip(x["ranked"], y["ranked"])):
            if p[:-2] != q[:-2] or any(not math.isclose(u, v, rel_tol=rel) for u, v in zip(p[-2:], q[-2:])):
                problems.append(f"#{i + 1}: {p} vs {q}")
        if len(x["ranked"]) != len(y["ranked"]):
            problems.append(f"{len(x['ranked'])} vs {len(y['ranked'])} ranked")
        if x["smallest"] != y["smallest"]:
            problems.append(f"smallest {x['smallest']} vs {y['smallest']}")
        print(f"{name}: {len(x['ranked'])} ranked, " + ("identical" if not problems else f"{len(problems)} differ"))
        for p in problems[:10]:
            print(f"  {p}")
        bad += bool(problems)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each (median; default 5)")
    parser.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    parser.add_argument("--dump", metavar="OUT", help="write every ranked candidate's figures instead")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two dumps instead")
    opts = parser.parse_args(argv)
    if opts.compare:
        return compare(Path(opts.compare[0]), Path(opts.compare[1]))
    if opts.dump:
        dump(Path(opts.dump))
        return 0
    out = bench(opts.runs)
    ref = out["reference_s"]
    print(f"reference workload ({REFERENCE_LOOPS:,} loops of pure Python): {ref:.3f} s")
    for name, what in (("search_70b", "70B search (in-process)"), ("command_405b", "405B `parakit plan` (wall)")):
        f = out[name]
        verdict = "meets" if f["seconds"] <= f["goal_s"] else "MISSES"
        print(
            f"{what}: {f['seconds']:.3f} s, goal {f['goal_s']:.1f} s ({verdict}); "
            f"{f['over_reference']:.2f} x the reference; {f['considered']} layouts; top-10 hash {f['top10_hash']}"
        )
    print(f"  (its search alone, in-process: {out['command_405b']['search_seconds']:.3f} s)")
    if opts.json:
        Path(opts.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
