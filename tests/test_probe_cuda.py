"""`parakit probe` on a CUDA machine, driven on this CPU machine: torch.cuda patched to report an
H200 (its name, properties, events and synchronize), the tensors on the CPU (the probe's `device`),
and a fake GPU clock that each GEMM and triad advances by the time a GPU of known speed would take.
What the probe measures must then be that GPU's figures (the GEMM rate flops / time, its
efficiency against the datasheet's peak, the triad's bandwidth, the SMs from the properties); the
host's own op dispatch and the filesystem's fsync'ed writes are measured for real (here); NCCL is
skipped on one GPU with its reason, fitted from the ranks' figures on two; each backend's stack runs
through the CPU probe's code on the GPU's cluster; and the cluster file composes and validates."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch

from toolkit.config import machine
from toolkit.config.store import compose_config
from toolkit.plan import machine_fit
from toolkit.plan.kernels import gemm_time
from toolkit.plan.validate import validate
from toolkit.report import probe as probe_report
from toolkit.train import machine_probe
from toolkit.train.machine_probe import GpuSizes

# the GPU the fake clock runs: 132 SMs, 62% of the H200 datasheet's 989.5 TFLOP/s in bf16
SMS, PEAK, EFFICIENCY, HBM, FP32 = 132, 989.5e12, 0.62, 3.9e12, 51e12
GPU = SimpleNamespace(sm_count=SMS, gemm_half_size=128.0, hbm_bandwidth_gbs=HBM / 1e9)
SMALL = GpuSizes(
    square=64,
    sustain_s=0.0,
    min_seconds=0.0,  # one call per batch: the fake clock needs no averaging
    models=(("tiny", 16, 1),),
    triad_bytes=2**16,
    dispatch_ops=200,
    write_bytes=2**20,
    write_seconds=5.0,
    write_chunk=2**18,
)


def true_gemm_seconds(m, n, k, dtype) -> float:
    if dtype == torch.float32:
        return 2 * m * n * k / FP32
    return gemm_time(GPU, m, n, k, PEAK * EFFICIENCY, 2)


class FakeGpu:
    """The fake device: a clock the kernels advance, CUDA events that read it, counted syncs."""

    def __init__(self):
        self.now, self.syncs, self.gemms = 0.0, 0, []
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.at = None

            def record(self, stream=None):
                self.at = gpu.now

            def synchronize(self):
                gpu.syncs += 1

            def elapsed_time(self, end):
                return (end.at - self.at) * 1000  # milliseconds, as CUDA's

        self.Event = Event

    def sync(self, *args, **kwargs):
        self.syncs += 1


@pytest.fixture
def gpu(monkeypatch):
    """torch.cuda patched to one H200; torch.mm and torch.add advance the fake clock."""
    fake = FakeGpu()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    properties = SimpleNamespace(multi_processor_count=SMS, total_memory=150_000_000_000, name="NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.sync)
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    mm, add = torch.mm, torch.add

    def timed_mm(a, b, *, out=None):
        (m, k), n = a.shape, b.shape[1]
        fake.now += true_gemm_seconds(m, n, k, a.dtype)
        fake.gemms.append((m, n, k))
        return mm(a, b, out=out)

    def timed_add(a, b, *, alpha=1, out=None):
        fake.now += 3 * out.numel() * out.element_size() / HBM  # the triad: two arrays read, one written
        return add(a, b, alpha=alpha, out=out)

    monkeypatch.setattr(torch, "mm", timed_mm)
    monkeypatch.setattr(torch, "add", timed_add)
    return fake


@pytest.fixture
def stacks(monkeypatch):
    """Each backend's stack runs (subprocesses on a GPU) replaced by their step seconds: what the
    planner predicts for the point on the probed GPU cluster, plus 0.4 ms per layer and micro-batch
    and 5 ms per step (the costs fit_stack must find)."""
    from toolkit.plan.layout import resolve
    from toolkit.plan.perf import estimate_step

    calls, fitted = [], {}
    gpu_constants = machine_fit.gpu_constants

    def measured_constants(*args, **kwargs):  # what the probe fitted before its stack runs
        fitted.update(gpu_constants(*args, **kwargs))
        return dict(fitted)

    def measure_stack(backend, points, world=1, cluster=None, passes=2):
        calls.append({"backend": backend, "points": points, "world": world, "cluster": cluster, "passes": passes})
        seconds = []
        for layers, vocab, tp in points:
            cfg = compose_config(machine_fit.stack_overrides(backend, layers, vocab, tp, cluster))
            cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, **fitted, stack={}))
            layout = resolve(cfg)
            seconds.append(
                estimate_step(cfg, layout).step_time + 4e-4 * layers * layout.num_microbatches + 5e-3 + 1e-4 * (tp > 1)
            )
        return seconds

    monkeypatch.setattr(machine_fit, "gpu_constants", measured_constants)
    monkeypatch.setattr(machine_probe, "measure_stack", measure_stack)
    return calls


def test_the_gemm_rate_is_flops_over_the_gpus_time_and_its_efficiency_is_against_the_datasheet_peak(gpu):
    shapes = machine_probe.model_gemm_shapes(SMALL.models)
    # the tiny model's layers at 16 tokens: qkv 64 -> 128, proj, fc1 64 -> 384, fc2, the output layer
    assert [16, 128, 64] in shapes and [16, 64, 128] in shapes and [64, 128, 16] in shapes
    assert [16, 384, 64] in shapes and [16, 64, 192] in shapes and [16, 50304, 64] in shapes
    figures = machine_probe.gemm_times_gpu(shapes, "cpu", SMALL)
    rows = figures["gemm_bf16"]
    assert [r[:3] for r in rows] == [*shapes, [64, 64, 64]]  # the model's shapes, the square last
    for m, n, k, seconds in rows:  # each rate the GPU's own: flops / its time
        assert 2 * m * n * k / seconds == pytest.approx(2 * m * n * k / true_gemm_seconds(m, n, k, torch.bfloat16))
    assert 2 * 64**3 / figures["square_fp32"][3] == pytest.approx(FP32)
    triad = machine_probe.triad_time("cpu", SMALL.triad_bytes, 0.0)
    assert triad[0] == 3 * SMALL.triad_bytes and triad[0] / triad[1] == pytest.approx(HBM)
    raw = {
        "gpu": {"sm_count": SMS, "memory_gb": 150.0, "count": 1},
        "per_rank": [{**figures, "triad": triad, "dispatch": {"autograd_s": 1e-5}}],
        "transformer_engine": False,
        "write": {"bytes": 2e9, "seconds": 1.0},
    }
    constants = machine_fit.gpu_constants(raw, compose_config(["cluster=1xh200"]).cluster)
    assert constants["gemm_efficiency"] == pytest.approx(EFFICIENCY, rel=1e-4)
    assert constants["sm_count"] == SMS and constants["hbm_bandwidth_gbs"] == pytest.approx(HBM / 1e9)
    assert "peak_tflops_bf16" not in constants  # the datasheet's peak stays
    # a GPU no datasheet describes: its peaks are its square GEMMs' rates, efficiency against them
    unknown = machine_fit.gpu_constants(raw, compose_config(["cluster=1xh200"]).cluster, measured_peaks=True)
    square = 2 * 64**3 / rows[-1][3]
    assert unknown["peak_tflops_bf16"] == pytest.approx(square / 1e12)
    assert unknown["peak_tflops_fp32"] == pytest.approx(FP32 / 1e12) and unknown["gpu_memory_gb"] == 150.0


def test_op_dispatch_is_the_hosts_time_per_eager_op_up_to_a_synchronize(gpu, monkeypatch):
    before, recording = gpu.syncs, []
    add = torch.Tensor.__add__
    monkeypatch.setattr(torch.Tensor, "__add__", lambda x, y: recording.append(x.requires_grad) or add(x, y))
    dispatch = machine_probe.dispatch_time("cpu", 200)
    # op_dispatch_s's ops record autograd's graph, as a training forward's do: warm-up and 5 batches
    assert recording.count(True) == 6 * 200 and recording.count(False) == 5 * 200
    # on this CPU an eager add is issued and run by the host: microseconds, not nanoseconds or ms
    assert 1e-7 < dispatch["no_grad_s"] < 1e-3 and 1e-7 < dispatch["autograd_s"] < 1e-3, dispatch
    assert dispatch["autograd_s"] > 0.8 * dispatch["no_grad_s"]  # recording the graph costs, never saves
    assert gpu.syncs - before == 2 * 11  # each batch starts and ends on a synchronized device (warm + 2 x 5)


def test_the_checkpoint_write_bandwidth_is_of_fsynced_writes_in_the_directory(tmp_path, monkeypatch):
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or fsync(fd))
    written = machine_probe.write_bandwidth(tmp_path, 2**20, 5.0, 2**18)
    assert written["bytes"] == 2**20 and len(synced) == 4  # every chunk made durable before the next
    assert written["seconds"] > 0 and written["directory"] == str(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the file is gone
    capped = machine_probe.write_bandwidth(tmp_path, 2**30, 0.0, 2**18)
    assert capped["bytes"] == 2**18  # the time cap: one chunk at least, then stop


def test_the_gpu_probe_on_one_gpu_measures_writes_and_skips_nccl_with_its_reason(gpu, stacks, tmp_path, monkeypatch):
    def no_ranks(*args):
        raise AssertionError("one GPU: no process per GPU, no NCCL")

    monkeypatch.setattr(machine_probe, "_run_ranks", no_ranks)
    result = machine_probe.probe_gpu(tmp_path, SMALL, device="cpu")
    c, raw = result["constants"], result["raw"]
    assert raw["gpu"] | {"torch": None} == {
        "name": "NVIDIA H200",
        "count": 1,
        "sm_count": SMS,
        "memory_gb": 150.0,
        "datasheet": "1xh200",
        "torch": None,
        "cuda": "13.0",
    }
    assert c["gemm_efficiency"] == pytest.approx(EFFICIENCY, rel=1e-4) and c["sm_count"] == SMS
    assert c["hbm_bandwidth_gbs"] == pytest.approx(HBM / 1e9)
    assert 1e-7 < c["op_dispatch_s"] < 1e-3
    assert c["transformer_engine"] is False  # not importable here
    assert c["checkpoint_write_gbs_per_node"] == pytest.approx(raw["write"]["bytes"] / raw["write"]["seconds"] / 1e9)
    assert raw["write"]["bytes"] == 2**20 and raw["write"]["directory"] == str(tmp_path)
    assert "collectives" not in raw["per_rank"][0] and "intra_node_bandwidth_gbs" not in c
    assert result["skipped"]["collectives"].startswith("one GPU: no NCCL collective to measure")
    # the CPU probe's stack code on the GPU's cluster in bf16, one rank, once per point
    gpu_cluster = ["cluster=1xh200", "precision=bf16"]
    assert [(s["backend"], s["world"], s["cluster"], s["passes"]) for s in stacks] == [
        ("megatron", 1, gpu_cluster, 1),
        ("deepspeed", 1, gpu_cluster, 1),
    ]
    assert result["skipped"]["megatron_tp_layer_s"] == "tensor parallel's cost per layer needs two GPUs"
    for backend in ("megatron", "deepspeed"):
        costs = result["stack"][backend]
        assert costs["layer_s"] == pytest.approx(4e-4, rel=1e-6) and costs["step_s"] == pytest.approx(5e-3, rel=1e-6)
        assert costs["loss_s_per_logit"] == pytest.approx(0, abs=1e-15) and costs["tp_layer_s"] == 0.0

    text = probe_report.gpu_cluster_file("h200_probed", result, ["parakit", "probe", "--name", "h200_probed"])
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert "1 x NVIDIA H200 (132 SMs, 150.0 GB)" in header[0] and "`parakit probe`" in header[0]
    assert header[1].startswith(f"# torch {torch.__version__}, CUDA 13.0; command: parakit probe --name h200_probed")
    assert any("not measured: collectives: one GPU" in line for line in header)
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "h200_probed.yaml").write_text(text)
    cfg = compose_config(["cluster=h200_probed", "model=tiny", "parallel=dp"], config_dirs=[tmp_path])
    cluster = cfg.cluster
    assert cluster.name == "h200_probed" and cluster.gpu == "NVIDIA H200" and cluster.device == "cuda"
    assert (cluster.nodes, cluster.gpus_per_node) == (1, 1)
    assert cluster.peak_tflops_bf16 == 989.5  # the datasheet's
    for field, value in c.items():
        assert getattr(cluster, field) == pytest.approx(value), field
    assert cluster.stack["deepspeed"].layer_s == pytest.approx(4e-4)
    assert validate(cfg).ok, validate(cfg)


def test_the_gpu_probe_on_two_gpus_runs_every_gpu_and_fits_ncclS_ring(gpu, stacks, tmp_path, monkeypatch):
    """Two GPUs: one process per GPU (_gpu_rank_main, NCCL), faked here by running each GPU's
    compute in this process and NCCL's times from a ring of known bandwidth and latency, with the
    all-gather and reduce-scatter rows in each rank's bytes as the probe records them."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    bandwidth, latency = 3.6e11, 8e-6
    sizes = [2**k for k in range(12, 29, 4)]
    spawned = []

    def run_ranks(target, args, world):
        spawned.append((target, args[0], world))
        per_rank = []
        for rank in range(world):
            result = machine_probe.gpu_compute("cpu", args[2], args[3], say=lambda line: None)
            if rank == 1:  # the second chip 4% slower at the square
                result["gemm_bf16"][-1][3] *= 1.04
            result["collectives"] = {
                "2": {
                    kind: [
                        [b, machine_fit.ring_time(kind, b * (2 if kind != "all_reduce" else 1), 2, bandwidth, latency)]
                        for b in sizes
                    ]  # fmt: skip
                    for kind in ("all_reduce", "all_gather", "reduce_scatter")
                }
                | {"send_recv": [[b, machine_fit.ring_time("send_recv", b, 2, 2e11, 1e-5)] for b in sizes]}
            }
            per_rank.append(result)
        return per_rank

    monkeypatch.setattr(machine_probe, "_run_ranks", run_ranks)
    result = machine_probe.probe_gpu(tmp_path, SMALL, device="cpu")
    c = result["constants"]
    assert spawned == [(machine_probe._gpu_rank_main, 2, 2)]
    assert "collectives" not in result["skipped"] and "megatron_tp_layer_s" not in result["skipped"]
    assert c["intra_node_bandwidth_gbs"] == pytest.approx(bandwidth / 1e9, rel=1e-3)
    assert c["collective_latency_s"] == pytest.approx(latency, rel=1e-3)
    assert c["p2p_bandwidth_gbs"] == pytest.approx(200, rel=1e-3) and c["p2p_latency_s"] == pytest.approx(
        1e-5, rel=1e-3
    )
    assert c["gemm_chip_spread"] == pytest.approx((1 - 1 / 1.04) / ((1 + 1 / 1.04) / 2))
    # the bus bandwidth nccl-tests would print for the 256 MiB all-reduce: the ring's, after efficiency
    b, t = result["raw"]["per_rank"][0]["collectives"]["2"]["all_reduce"][-1]
    assert machine_fit.bus_bandwidth("all_reduce", b, 2, t) == pytest.approx(
        bandwidth * machine_fit.COLLECTIVE_EFFICIENCY,
        rel=0.02,  # less the ring's 2 steps of latency
    )
    tp_runs = [s for s in stacks if s["world"] == 2]  # tensor parallel's own layers on the two GPUs
    assert [(s["backend"], s["points"]) for s in tp_runs] == [("megatron", [(10, 1024, 2)])]
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "node.yaml").write_text(probe_report.gpu_cluster_file("node", result))
    cluster = compose_config(["cluster=node"], config_dirs=[tmp_path]).cluster
    assert (cluster.nodes, cluster.gpus_per_node) == (1, 2)  # the node's GPUs
    assert cluster.intra_node_bandwidth_gbs == pytest.approx(bandwidth / 1e9, rel=1e-3)
    assert cluster.stack["megatron"].tp_layer_s == pytest.approx(result["stack"]["megatron"]["tp_layer_s"])


def test_parakit_probe_on_a_gpu_measures_anew_and_writes_the_cluster_file(gpu, tmp_path, monkeypatch, capsys):
    """The command on a CUDA machine: the GPU probe's subprocess (always run again, its figures kept
    under the GPU's fingerprint), then the cluster file in -o, which composes as cluster=NAME."""
    monkeypatch.setenv(machine.CACHE_ENV, str(tmp_path / "cache"))
    commands = []
    canned = {
        "device": "cuda",
        "constants": {
            "gemm_efficiency": 0.7,
            "sm_count": SMS,
            "hbm_bandwidth_gbs": 4000.0,
            "op_dispatch_s": 9e-6,
            "transformer_engine": False,
            "checkpoint_write_gbs_per_node": 1.1,
        },  # fmt: skip
        "stack": {"megatron": {"layer_s": 1e-4, "loss_s_per_logit": 0.0, "step_s": 2e-3, "tp_layer_s": 0.0}},
        "raw": {
            "gpu": {
                "name": "NVIDIA H200",
                "count": 1,
                "sm_count": SMS,
                "memory_gb": 150.0,
                "datasheet": "1xh200",
                "torch": torch.__version__,
                "cuda": "13.0",
            },  # fmt: skip
            "per_rank": [{"gemm_bf16": [[8192, 8192, 8192, 1.5e-3]]}],
            "models": [["llama3_1b", 2048, 2]],
            "write": {"bytes": 2**30, "seconds": 1.0, "chunk": 2**26, "directory": str(tmp_path)},
        },
        "skipped": {"collectives": "one GPU: ..."},
        "seconds": 40.0,
    }

    def fake_probe(command, env):
        commands.append(command)
        with open(command[command.index("--output") + 1], "w") as f:
            json.dump(canned, f)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(machine.subprocess, "run", fake_probe)
    opts = SimpleNamespace(force=False, output=str(tmp_path / "out"), name="mine")
    for _ in range(2):  # no --force: a GPU is measured anyway
        assert probe_report.probe_command(opts) == 0
    assert len(commands) == 2
    given = dict(zip(commands[0][3::2], commands[0][4::2]))  # after `python -m toolkit.train.machine_probe`
    assert given["--device"] == "cuda" and given["--write-dir"] == str(tmp_path / "out")
    kept = machine.cache_path(machine.fingerprint("cuda"))
    assert kept.is_file() and kept != machine.cache_path()  # beside, never instead of, the CPU probe
    assert json.loads(kept.read_text())["fingerprint"]["gpu"] == "NVIDIA H200"
    out = capsys.readouterr().out
    assert "this machine (1 x NVIDIA H200)" in out and "not measured: collectives: one GPU" in out
    assert "op_dispatch_s" in out and "cluster=mine" in out
    cluster = compose_config(["cluster=mine"], config_dirs=[tmp_path / "out"]).cluster
    assert cluster.gemm_efficiency == 0.7 and cluster.hbm_bandwidth_gbs == 4000.0 and cluster.op_dispatch_s == 9e-6
    assert cluster.transformer_engine is False and cluster.checkpoint_write_gbs_per_node == 1.1
    assert cluster.stack["megatron"].step_s == 2e-3
    text = (tmp_path / "out" / "cluster" / "mine.yaml").read_text()
    assert "733 TFLOP/s" in text  # 8192^3 in 1.5 ms, in the provenance


@pytest.mark.parametrize(
    "name, datasheet",
    [
        ("NVIDIA H200", "1xh200"),
        ("NVIDIA H100 80GB HBM3", "8xh100"),
        ("NVIDIA A100-SXM4-80GB", "a100_cluster"),
        ("Tesla V100-SXM2-32GB", "v100_cluster"),
        ("NVIDIA L40S", None),
    ],
)
def test_the_datasheet_is_the_cluster_file_of_the_gpus_model(name, datasheet):
    from toolkit.config import store

    assert store.datasheet_cluster(name) == datasheet


def test_the_stack_runs_on_the_gpus_cluster_in_bf16():
    overrides = machine_fit.stack_overrides("megatron", 2, 1024, 1, ["cluster=1xh200", "precision=bf16"])
    cfg = compose_config(overrides)
    assert cfg.cluster.device == "cuda" and cfg.precision.dtype == "bf16" and cfg.model.num_layers == 2
    assert cfg.cluster.gpus_per_node == 1 and not math.isnan(cfg.cluster.peak_tflops_bf16)
    cpu = compose_config(machine_fit.stack_overrides("megatron", 2, 1024))
    assert cpu.cluster.device == "cpu" and cpu.precision.dtype == "fp32"


def test_a_one_node_datasheet_is_preferred_for_the_node_the_probe_measures(tmp_path, monkeypatch):
    from toolkit.config import store

    (tmp_path / "cluster").mkdir()
    for name, nodes in (("a_pod", 8), ("b_node", 1)):
        (tmp_path / "cluster" / f"{name}.yaml").write_text(
            f"name: {name}\ndevice: cuda\ngpu: H100-SXM\nnodes: {nodes}\n"
        )
    (tmp_path / "cluster" / "c_cpu.yaml").write_text("name: c_cpu\ndevice: cpu\ngpu: H100-SXM\nnodes: 1\n")
    monkeypatch.setattr(store, "conf_dir", lambda: tmp_path)
    assert store.datasheet_cluster("NVIDIA H100 80GB HBM3") == "b_node"
