"""The slow rank named during the run (toolkit.train.stragglers): which ranks count as slow, and the
slow-rank drill (train.fault.slow_rank) found on two CPU ranks, on the console and in metrics.jsonl."""

import pytest
from training_runs import jsonl

from toolkit.train.stragglers import slow_ranks


def rank(number: int, seconds: float, stage: int = 0) -> dict:
    return {"rank": number, "host": "node", "local_rank": number % 8, "stage": stage, "compute_s": seconds}


def test_a_rank_over_its_peers_median_by_more_than_the_threshold_is_named():
    ranks = [rank(0, 1.0), rank(1, 1.02), rank(2, 0.98), rank(3, 1.5)]
    (slow,) = slow_ranks(ranks, 0.2)
    assert slow["rank"] == 3 and slow["median_s"] == 1.0 and slow["over"] == pytest.approx(0.5)
    assert slow_ranks(ranks, 0.6) == []


def test_two_ranks_compare_with_each_other_and_stages_with_their_own_ranks():
    (slow,) = slow_ranks([rank(0, 1.0), rank(1, 2.0)], 0.2)  # a 2x slower rank is 100% over, not 33%
    assert slow["rank"] == 1 and slow["over"] == pytest.approx(1.0)
    # the last pipeline stage computes the loss too: slower than the first, and no rank of it is slow
    stages = [rank(0, 1.0, 0), rank(1, 1.0, 0), rank(2, 1.6, 1), rank(3, 1.6, 1)]
    assert slow_ranks(stages, 0.2) == []
    assert [r["rank"] for r in slow_ranks([*stages[:3], rank(3, 2.4, 1)], 0.2)] == [3]
    assert slow_ranks([rank(0, 1.0, 0), rank(1, 3.0, 1)], 0.2) == []  # one rank a stage: nothing to compare


@pytest.mark.slow
def test_the_slow_rank_drill_is_found_on_two_ranks(two_ranks_one_slow):
    result = two_ranks_one_slow
    windows = [r for r in jsonl(result.run_dir) if "slow_ranks" in r]
    assert [w["steps"] for w in windows] == [[1, 3], [4, 6]]
    for window in windows:
        (slow,) = window["slow_ranks"]
        assert (slow["rank"], slow["local_rank"], slow["stage"]) == (1, 1, 0) and slow["over"] > 0.2
        assert slow["compute_s"] - slow["median_s"] > 0.4  # the drill's half second a step
    assert "slow rank 1 (host " in result.stdout and "pipeline stage 0" in result.stdout


def test_a_drill_on_a_rank_the_job_does_not_have_is_refused(compose):
    from toolkit.plan.validate import validate

    report = validate(compose("model=tiny", "cluster.gpus_per_node=2", "train.fault.slow_rank=2"))
    (error,) = [e for e in report.errors if e.rule == "fault_rank"]
    assert "0..1" in error.fix and "train.fault.slow_rank" in error.fix
    assert not [e for e in validate(compose("model=tiny", "train.fault.kill_rank=3")).errors if e.rule == "fault_rank"]
