"""`parakit probe` and the default cpu cluster's measured constants.

- The fits (toolkit/plan/machine_fit.py) give back known constants from figures made with them,
  with +-5% noise: the GEMM rate and the half size, a ring's latency and bandwidth, point-to-point.
- The cache: the cpu cluster composes with the cached figures of this machine's fingerprint; a
  changed fingerprint probes again (once); PARAKIT_PROBE=0 gives the cluster file's guesses; a
  failed probe leaves no cache behind.
- This machine's real probe (the suite's cached one): its GEMM model predicts GEMMs of shapes
  outside its grid, timed here, and its collective model a 3-rank all-reduce it never measured.
- `parakit probe -o DIR --name NAME` writes a cluster file that composes as cluster=NAME.
The planner's step time with these constants against real runs: scripts/bench_probe.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from toolkit.config import machine
from toolkit.config.store import compose_config
from toolkit.plan import machine_fit
from toolkit.plan.kernels import shape_efficiency

# what the fake probe below reports (every constant the cpu cluster file reads)
FAKE = {
    "peak_tflops_fp32": 0.0,
    "peak_tflops_bf16": 0.2,
    "gemm_efficiency": 1.0,
    "gemm_half_size": 9.0,
    "hbm_bandwidth_gbs": 30.0,
    "fresh_memory_gbs": 2.0,
    "intra_node_bandwidth_gbs": 0.4,
    "collective_latency_s": 1e-3,
    "p2p_bandwidth_gbs": 2.0,
    "p2p_latency_s": 3e-4,
    "checkpoint_write_gbs_per_node": 0.3,
}
NOISE = (0.05, -0.04, 0.02, -0.05, 0.03, -0.01, 0.04, -0.03)


def _noisy(rows):
    return [[*r[:-1], r[-1] * (1 + NOISE[i % len(NOISE)])] for i, r in enumerate(rows)]


def test_the_gemm_fit_gives_back_the_rate_and_the_half_size():
    peak, half = 9e10, 12.0
    grid = [(m, n, k) for m in (64, 256, 1024) for n in (16, 64, 256, 1024) for k in (16, 64, 256, 1024)]
    rows = _noisy([[m, n, k, 2 * m * n * k / (peak * shape_efficiency(half, m, n, k))] for m, n, k in grid])
    fitted_peak, fitted_half = machine_fit.fit_gemm(rows)
    # a fit that ignored the shapes (the best rate seen) would be 10% under peak at 1024^3
    # and leave small shapes 2-3x off: 5% on each catches it
    assert fitted_peak == pytest.approx(peak, rel=0.05) and fitted_half == pytest.approx(half, rel=0.1)
    bf16 = _noisy([[m, n, k, 2 * m * n * k / (2 * peak * shape_efficiency(half, m, n, k))] for m, n, k in grid])
    assert machine_fit.fit_peak(bf16, fitted_half) == pytest.approx(2 * peak, rel=0.05)


def test_the_ring_fit_gives_back_latency_and_bandwidth():
    bandwidth, latency = 4e8, 1e-3
    sizes = [2**k for k in range(12, 25, 2)]
    groups = {
        str(g): {kind: [[b, machine_fit.ring_time(kind, b, g, bandwidth, latency)] for b in sizes] for kind in kinds}
        for g, kinds in ((4, ("all_reduce", "all_gather")), (2, ("all_reduce", "reduce_scatter")))
    }
    groups = {g: {k: _noisy(rows) for k, rows in kinds.items()} for g, kinds in groups.items()}
    fitted_bandwidth, fitted_latency = machine_fit.fit_collectives(groups)
    assert fitted_bandwidth == pytest.approx(bandwidth, rel=0.1) and fitted_latency == pytest.approx(latency, rel=0.1)
    p2p = _noisy([[b, machine_fit.ring_time("send_recv", b, 2, 2e9, 3e-4)] for b in sizes])
    assert machine_fit.fit_p2p(p2p) == pytest.approx((2e9, 3e-4), rel=0.1)


def test_the_stream_fit_reads_bandwidth_and_fresh_pages_from_the_large_tensors():
    rows = [[3 * b, 3 * b / 7e10, 3 * b / 7e10] for b in (2**18, 2**22)]  # in cache: fast, reused
    rows += [[3 * b, 3 * b / 2.5e10, 3 * b / 2.5e10 + b / 2e9] for b in (2**26, 2**27)]
    assert machine_fit.fit_stream(rows) == pytest.approx((2.5e10, 2e9))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty probe cache, and a probe subprocess that writes known figures (counting calls)."""
    monkeypatch.setenv(machine.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(machine.PROBE_ENV, raising=False)
    monkeypatch.setattr(machine, "_loaded", None)
    calls = []

    def fake_probe(command, env):
        calls.append(command)
        out = command[command.index("--output") + 1]
        constants = dict(FAKE, peak_tflops_fp32=0.25 + len(calls))
        stack = {"megatron": {"layer_s": 0.004, "loss_s_per_logit": 1e-8, "step_s": 0.02}}
        with open(out, "w") as f:
            json.dump({"constants": constants, "stack": stack, "raw": {}, "seconds": 1.0}, f)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(machine.subprocess, "run", fake_probe)
    return tmp_path, calls


def test_the_cpu_cluster_takes_this_machines_cached_figures_and_probes_once(cache, monkeypatch):
    tmp_path, calls = cache
    cluster = compose_config([]).cluster
    assert len(calls) == 1 and cluster.peak_tflops_fp32 == 1.25 and cluster.gemm_half_size == 9.0
    assert cluster.stack["megatron"].layer_s == 0.004  # typed: the planner reads attributes
    assert cluster.hbm_bandwidth_gbs == 30.0 and cluster.inter_node_bandwidth_gbs == 1.0  # one node: not probed
    assert compose_config(["cluster.peak_tflops_fp32=3"]).cluster.peak_tflops_fp32 == 3  # an override wins
    monkeypatch.setattr(machine, "_loaded", None)  # a new process: the cache file, no probe
    assert compose_config([]).cluster.peak_tflops_fp32 == 1.25 and len(calls) == 1
    assert [p.name for p in tmp_path.glob("probe-*.json")] == [machine.cache_path().name]
    real = machine._fingerprint()
    monkeypatch.setattr(machine, "_fingerprint", lambda: real.replace('"cores"', '"cores_"'))  # another machine
    assert compose_config([]).cluster.peak_tflops_fp32 == 2.25 and len(calls) == 2
    monkeypatch.setenv(machine.PROBE_ENV, "0")
    guessed = compose_config([]).cluster
    assert guessed.peak_tflops_fp32 == 0.1 and guessed.stack == {} and len(calls) == 2


def test_a_failed_probe_says_so_and_caches_nothing(cache, monkeypatch):
    tmp_path, _ = cache
    monkeypatch.setattr(machine.subprocess, "run", lambda command, env: subprocess.CompletedProcess(command, 1))
    with pytest.raises(Exception, match="the machine probe failed.*PARAKIT_PROBE=0"):
        compose_config([])
    assert not list(tmp_path.glob("probe-*.json"))


@pytest.fixture(scope="module")
def probe():
    """This machine's probe, as the suite's cpu cluster has it (measured once per checkout)."""
    return machine.run_probe()


def test_the_measured_gemm_model_predicts_shapes_it_never_timed(probe):
    """The tiny model's own GEMMs (qkv 64->128, fc1 64->384, an attention-sized 512x64x192), none
    of them in the probe's grid, timed here on one thread against rate x shape efficiency, each
    beside a shape of the grid (256^3) timed with it: this shared VM runs the same GEMM anywhere
    from 26 to 98 GFLOP/s within a minute, so the shape model is judged relative to the machine's
    speed of the moment (within 50%, measured +2%..+30%; the cluster file's guessed half size 128 is
    3-14x off), and the level on its own within 2.5x (a rate in the wrong unit is 1000x off). The
    output layer (64 -> 25216) runs 1.7-2.3x slower than the grid predicts (its 26 MB result leaves the caches):
    what the stack probe's per-logit cost adds (fit_stack), so it is only checked not to be faster."""
    import statistics

    import torch

    from toolkit.train.machine_probe import _timed

    torch.set_num_threads(1)
    c = probe["constants"]

    def gemm(m, n, k):  # (the call, its predicted seconds)
        a, b, out = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
        rate = c["peak_tflops_fp32"] * 1e12 * shape_efficiency(c["gemm_half_size"], m, n, k)
        return (lambda: torch.mm(a, b, out=out)), 2 * m * n * k / rate

    errors = []
    for shape in ((256, 128, 64), (256, 384, 64), (512, 64, 192), (256, 25216, 64)):
        (unseen, unseen_s), (grid, grid_s) = gemm(*shape), gemm(256, 256, 256)
        # alternate short batches of the two, so that both see the machine's same moments
        times = [[_timed(fn, 0.01) for fn in (unseen, grid)] for _ in range(10)]
        measured_unseen, measured_grid = (statistics.fmean(t[i] for t in times) for i in (0, 1))
        assert 1 / 2.5 < grid_s / measured_grid < 2.5, grid_s / measured_grid
        errors.append((unseen_s / measured_unseen) / (grid_s / measured_grid) - 1)
    assert max(map(abs, errors[:3])) < 0.5, errors
    assert errors[3] < 0.2, errors


def test_the_stack_costs_are_measured_for_every_backend(probe):
    from toolkit.plan.backends import BACKENDS

    assert set(probe["stack"]) == set(BACKENDS)
    for costs in probe["stack"].values():
        # a layer's dispatch on CPU is milliseconds, a logit's loss nanoseconds, not 0 and not seconds
        assert 1e-4 < costs["layer_s"] < 0.1 and 1e-10 < costs["loss_s_per_logit"] < 1e-6, costs
        assert 0 <= costs["tp_layer_s"] < 0.1, costs
    assert all(math.isfinite(v) and v > 0 for v in probe["constants"].values())


def test_parakit_probe_writes_a_cluster_file_that_composes(probe, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "toolkit.cli", "probe", "-o", str(tmp_path), "--name", "mine"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "measuring this machine" not in done.stderr  # cached: no second probe
    assert "cluster=mine" in done.stdout and "megatron stack: layer_s" in done.stdout
    cluster = compose_config(["cluster=mine"], config_dirs=[tmp_path]).cluster
    assert cluster.name == "mine" and cluster.peak_tflops_fp32 == pytest.approx(probe["constants"]["peak_tflops_fp32"])
    assert cluster.stack["deepspeed"].step_s == pytest.approx(probe["stack"]["deepspeed"]["step_s"])
