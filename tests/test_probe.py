"""Each rank's own measurements (toolkit.train.probe): the peak bytes tensors held on CPU, the
compute seconds megatron-core's schedule reports through its timers, and the time per pipeline
stage taken from every rank's figures. The multi-rank runs that record them are checked where
they run (test_sweep.py, the pipeline tests of test_train_megatron.py and test_train_deepspeed.py)."""

from __future__ import annotations

import time

import pytest
import torch

from toolkit.train.probe import PROFILED_STEPS, ComputeTimers, MemoryProbe, stage_times

MIB = 2**20


def test_the_tensor_peak_is_the_most_bytes_held_at_once():
    probe = MemoryProbe(profile_tensors=True)
    weights = torch.ones(8 * MIB // 4)  # 8 MiB held through the steps
    for _ in range(PROFILED_STEPS):
        activations = [torch.ones(4 * MIB // 4) for _ in range(3)]  # 12 MiB live at once, then freed
        del activations
        probe.step_done()
    assert probe.tensor_peak_bytes is not None
    # weights + activations, and nothing that was freed counted twice (a missed free adds 12 MiB a step)
    assert 20 * MIB <= probe.tensor_peak_bytes < 22 * MIB, probe.tensor_peak_bytes / MIB
    after = torch.ones(64 * MIB // 4)  # profiling has stopped: no longer counted
    probe.close()
    assert probe.tensor_peak_bytes < 22 * MIB
    peaks = probe.peaks()
    assert peaks["tensor_peak_gib"] == pytest.approx(probe.tensor_peak_bytes / 2**30)
    assert peaks["peak_rss_gib"] * 2**30 > 64 * MIB  # the resident set does hold the last tensor
    del weights, after


def test_without_profiling_only_the_resident_set_is_known():
    probe = MemoryProbe(profile_tensors=False)
    probe.step_done()
    assert probe.peaks()["tensor_peak_gib"] is None and probe.peaks()["peak_rss_gib"] > 0


def test_compute_timers_count_megatron_cores_compute_timers_only():
    timers = ComputeTimers()
    for name in ("forward-compute", "forward-recv", "backward-compute", "forward-backward"):
        timers(name, log_level=2).start(barrier=False)
        time.sleep(0.02)
        timers(name).stop()
    assert 0.04 <= timers.seconds < 0.07  # the two compute spans, not the receive or the whole step
    with timers.timing():
        time.sleep(0.02)
    assert timers.seconds >= 0.06
    timers.reset()
    assert timers.seconds == 0.0


class _FakeEvent:
    """torch.cuda.Event on CPU: records the host time; elapsed_time in milliseconds, as CUDA's."""

    synchronized = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self, stream=None):
        self.at = time.perf_counter()

    def synchronize(self):
        _FakeEvent.synchronized += 1

    def elapsed_time(self, end):
        return (end.at - self.at) * 1000


def test_on_a_gpu_the_compute_timers_never_synchronise_inside_the_step(monkeypatch):
    """The CUDA branch, driven on CPU: every span is a pair of events on the stream; the device is
    never synchronised while the step runs (a synchronize per micro-batch serialised compute with
    communication), and reading the step's seconds waits for the last event once."""
    device_syncs = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: device_syncs.append(1))
    _FakeEvent.synchronized = 0
    timers = ComputeTimers()
    for _ in range(8):  # micro-batches
        for name in ("forward-compute", "backward-compute"):
            timers(name).start()
            time.sleep(0.005)
            timers(name).stop()
    assert device_syncs == [] and _FakeEvent.synchronized == 0
    assert 0.075 <= timers.seconds < 0.2  # 16 spans of 5 ms, summed from the events
    assert _FakeEvent.synchronized == 1 and device_syncs == []
    timers.reset()
    assert timers.seconds == 0.0


def test_a_stage_takes_its_slowest_rank_per_step_then_the_median_after_the_warm_up():
    ranks = [
        {"rank": 0, "stage": 0, "compute_s": [9.0, 1.0, 1.0, 1.2]},
        {"rank": 1, "stage": 0, "compute_s": [9.0, 2.0, 2.0, 0.5]},  # dp replica of stage 0
        {"rank": 2, "stage": 1, "compute_s": [9.0, 3.0, 5.0, 4.0]},
        {"rank": 3, "stage": 1, "compute_s": [9.0, 3.0, 5.0, 4.0]},
    ]
    assert stage_times(ranks, pp=2, skip_steps=1) == [2.0, 4.0]  # stage 0: max per step 2, 2, 1.2
    assert stage_times(ranks[:1], pp=1, skip_steps=10) == [1.1]  # fewer steps than the warm-up: all
