"""The layout search's shortcuts change no result (issue 42 item 4: its speed is checked by
scripts/bench_search.py, not here).

The search keeps what depends only on sections its candidates share while it runs
(toolkit.plan.memo), resolves a layout once for its ZeRO stages and recomputes, skips a candidate
whose first stage alone is over the device and over the smallest seen, and asks the validator only
for errors. Here each search is repeated the plain way: every candidate a deep copy of itself (no
section shared with another), resolved, its peak memory computed, validated in full and estimated,
with nothing kept between calls. Every figure must be equal, not close."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import threading

import pytest

from toolkit.plan import memo
from toolkit.plan.layout import resolve
from toolkit.plan.memory import peak_memory
from toolkit.plan.parallel_dims import ParallelDims
from toolkit.plan.perf import estimate_step
from toolkit.plan.search import (
    HEADROOM,
    TRAFFIC_TRIED,
    Candidate,
    _rank,
    _with_traffic_settings,
    candidate_configs,
    search,
)
from toolkit.plan.validate import is_valid, validate

SEARCHES = {
    "uneven pipeline and vpp": ["model=gpt2_124m", "cluster=8xh100", "train.global_batch=16"],
    "context parallel": ["model=llama3_8b", "cluster=8xh100", "train=pretrain", "train.global_batch=8"],
    "experts": ["model=tiny_moe", "cluster=8xh100", "train.global_batch=8"],
    "nothing fits": ["model=llama3_70b", "cluster=8xh100", "train.global_batch=16"],
    "deepspeed": ["model=llama3_8b", "cluster=8xh100", "train.global_batch=16", "backend=deepspeed"],
    "cpu": ["model=tiny", "train.global_batch=8"],
}


def plain_search(cfg):
    """The search without its shortcuts: (ranked, considered, valid, fitting, smallest)."""
    assert memo._results.get() is None  # nothing is kept
    capacity = cfg.cluster.gpu_memory_gb * 1e9 * (1 - HEADROOM)
    considered = valid = 0
    fitting, smallest = [], None
    for shared in candidate_configs(cfg):
        c = copy.deepcopy(shared)
        considered += 1
        layout = resolve(c)
        memory = peak_memory(c, layout)
        if memory.total > capacity and smallest is not None and memory.total >= smallest.memory.total:
            continue
        if not validate(c, data=False, memory=False).ok:
            continue
        valid += 1
        candidate = Candidate(c, layout, memory, estimate_step(c, layout))
        if smallest is None or memory.total < smallest.memory.total:
            smallest = candidate
        if memory.total <= capacity:
            fitting.append(candidate)
    fitting.sort(key=_rank)
    fits = len(fitting)
    fitting = sorted(fitting + _with_traffic_settings(fitting[:TRAFFIC_TRIED], capacity), key=_rank)
    return fitting, considered, valid, fits, smallest


def _figures(c: Candidate) -> tuple:
    return c.cfg, c.layout, c.memory, c.step


@pytest.mark.parametrize("overrides", SEARCHES.values(), ids=SEARCHES.keys())
def test_the_search_ranks_what_the_plain_search_ranks_with_the_same_figures(compose, overrides):
    cfg = compose(*overrides)
    result = search(cfg)
    ranked, considered, valid, fits, smallest = plain_search(cfg)
    assert (result.considered, result.valid, result.fitting) == (considered, valid, fits)
    assert [_figures(c) for c in result.ranked] == [_figures(c) for c in ranked]  # exact: == on every float
    assert (smallest is None) == (result.smallest is None)
    if smallest is not None:
        assert _figures(result.smallest) == _figures(smallest)
    assert memo._results.get() is None  # the search's results are dropped when it ends


def test_is_valid_is_validate_ok_for_valid_and_invalid_candidates(compose):
    cfg = compose("model=llama3_8b", "cluster=h100_cluster", "cluster.nodes=2", "train=pretrain")
    cases = list(candidate_configs(cfg))[::20]
    cases += [
        compose("model=llama3_8b", "parallel.tp=3"),  # heads
        compose("model=llama3_8b", "train.micro_batch=0"),  # a range
        compose("model=llama3_8b", "optim.lr=nan"),  # not finite
        compose("model=llama3_8b", "backend=deepspeed", "parallel.cp=2"),  # a capability
    ]
    answers = [validate(c, data=False, memory=False).ok for c in cases]
    assert not all(answers[-4:]) and any(answers)
    assert [is_valid(c, data=False) for c in cases] == answers
    with memo.searching():  # and with the sections' ranges kept
        assert [is_valid(c, data=False) for c in cases] == answers
        assert [validate(c, data=False, memory=False) for c in cases[-4:]] == [
            validate(c, data=False, memory=False) for c in copy.deepcopy(cases[-4:])
        ]


def test_memo_keys_sections_by_identity_and_the_rest_by_value_and_type():
    calls = []

    @memo.during_search()
    def count(section, n):
        calls.append((section, n))
        return [section.x, n]

    @dataclasses.dataclass
    class Section:
        x: int

    a = Section(1)
    count(a, 1)
    a.x = 2
    assert count(a, 1) == [2, 1] and len(calls) == 2  # outside a search: read afresh every time
    with memo.searching():
        first = count(a, 1)
        assert count(a, 1) is first and len(calls) == 3
        assert count(Section(2), 1) == first and len(calls) == 4  # an equal section, not the same one
        assert count(a, 1.0) == [2, 1.0] and count(a, True) == [2, True] and len(calls) == 6
        assert count(a, n=1) == [2, 1] and len(calls) == 7  # by keyword: its own key
        with memo.searching():  # an inner scope shares the outer one's results
            assert count(a, 1) is first
        seen = []
        thread = threading.Thread(target=lambda: seen.append(memo._results.get()))
        thread.start()
        thread.join()
        assert seen == [None]  # another thread does not see this search's results
    assert memo._results.get() is None
    assert count.uncached(a, 1) == [2, 1]


def test_parallel_dims_read_their_degrees_as_attributes_and_stay_immutable():
    dims = ParallelDims(tp=2, pp=4, vpp=2)
    assert (dims.tp, dims.pp, dims.vpp, dims.cp, dims.dp, dims.ep, dims.etp) == (2, 4, 2, 1, 1, 1, 2)
    with pytest.raises(AttributeError, match="no parallel dimension 'xp'"):
        dims.xp
    with pytest.raises(AttributeError, match="immutable"):
        dims.tp = 4
    assert pickle.loads(pickle.dumps(dims)) == dims and copy.deepcopy(dims) == dims
    assert hash(dims) == hash(ParallelDims(tp=2, pp=4, vpp=2, etp=2))
    with pytest.raises(TypeError, match="no parallel dimension xp"):
        ParallelDims(xp=2)
