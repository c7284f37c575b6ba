"""`parakit probe`: measure this machine for the planner (toolkit.config.machine caches the
figures; the default CPU cluster reads them), print them, and write them as a cluster file. On a
CUDA machine it measures the GPUs instead (toolkit.train.machine_probe.probe_gpu) and writes the
GPU's datasheet cluster with what it measured."""

from __future__ import annotations

import dataclasses
import datetime
import shlex
import sys
from pathlib import Path

from omegaconf import OmegaConf

from toolkit.config import machine
from toolkit.config.store import compose_config
from toolkit.formats.atomic import write_atomic


def _value(value) -> str:
    return f"{value:>12.4g}" if isinstance(value, float) else f"{value!s:>12}"


def probe_command(opts) -> int:
    """`parakit probe`: measure (again, with --force; always on GPUs), print the constants, write
    the cluster file."""
    device = machine.probe_device()
    output = Path(opts.output)
    output.mkdir(parents=True, exist_ok=True)  # the GPU probe measures its filesystem's writes
    try:
        probe = machine.run_probe(force=opts.force, device=device, write_dir=output)
    except machine.ProbeError as e:
        print(f"parakit probe: {e}", file=sys.stderr)
        return 1
    print_ = probe["fingerprint"]
    where = (
        f"{print_['gpus']} x {print_['gpu']}" if device == "cuda" else f"{print_['processor']}, {print_['cores']} cores"
    )
    print(f"this machine ({where}), measured in {probe['seconds']:.0f} s, cached in {machine.cache_path(print_)}:")
    for field, value in probe["constants"].items():
        print(f"  {field:<30}{_value(value)}")
    for backend, costs in probe["stack"].items():
        print(f"  {backend} stack: " + ", ".join(f"{k} {v:.3g}" for k, v in costs.items()))
    for what, why in probe.get("skipped", {}).items():
        print(f"  not measured: {what}: {why}")
    target = output / "cluster" / f"{opts.name}.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, gpu_cluster_file(opts.name, probe) if device == "cuda" else cluster_file(opts.name))
    also = "" if device == "cuda" else "  (cluster=cpu uses the same figures while this machine stays as it is)"
    print(f"wrote {target}\nuse it: parakit plan --config-dir {opts.output} cluster={opts.name} ...{also}")
    return 0


def cluster_file(name: str) -> str:
    """The default CPU cluster with this machine's measured constants, as a config-group file
    (`cluster=NAME` with --config-dir), its provenance in comments."""
    cluster = dataclasses.replace(compose_config(["cluster=cpu"]).cluster, name=name)
    described = ", ".join(f"{k} {v}" for k, v in machine.fingerprint().items())
    header = f"# {name}: this machine measured by `parakit probe` ({described})\n"
    return header + OmegaConf.to_yaml(OmegaConf.structured(cluster))


def gpu_cluster_file(name: str, probe: dict, command: list[str] | None = None) -> str:
    """The GPU's datasheet cluster (conf/cluster, matched by its name) with every field the GPU
    probe measured, one node of this machine's GPUs, as a config-group file; its provenance
    (device, torch and CUDA versions, date, command, what was not measured) in comments."""
    from toolkit.config.schema import StackCosts
    from toolkit.train.machine_probe import FALLBACK_DATASHEET

    raw = probe["raw"]
    gpu, write = raw["gpu"], raw["write"]
    base = gpu["datasheet"] or FALLBACK_DATASHEET
    stack = {backend: StackCosts(**costs) for backend, costs in probe["stack"].items()}
    cluster = dataclasses.replace(
        compose_config([f"cluster={base}"]).cluster,
        name=name,
        gpu=gpu["name"],
        nodes=1,
        gpus_per_node=gpu["count"],
        **probe["constants"],
        stack=stack,
    )
    square = raw["per_rank"][0]["gemm_bf16"][-1]
    models = ", ".join(f"{m} (seq {s} x micro batch {b})" for m, s, b in raw["models"])
    command = command or ["parakit", *sys.argv[1:]]
    lines = [
        f"{name}: {gpu['count']} x {gpu['name']} ({gpu['sm_count']} SMs, {gpu['memory_gb']:.1f} GB) measured by "
        f"`parakit probe` on {datetime.date.today().isoformat()} in {probe['seconds']:.0f} s",
        f"torch {gpu['torch']}, CUDA {gpu['cuda']}; command: {shlex.join(command)}",
        (
            f"peaks from conf/cluster/{base}.yaml; gemm_efficiency fitted over the bf16 GEMMs of {models} and "
            f"{square[0]}^3 ({2 * square[0] ** 3 / square[3] / 1e12:.0f} TFLOP/s)"
            if gpu["datasheet"]
            else f"no conf/cluster file describes this GPU: {base}'s file with the peaks measured here"
        ),
        "measured: " + ", ".join(probe["constants"]) + ", stack",
        f"checkpoint writes: {write['bytes'] / 2**20:.0f} MiB in fsync'ed chunks of {write['chunk'] / 2**20:g} MiB "
        f"into {write['directory']}",
        *(f"not measured: {what}: {why}" for what, why in probe.get("skipped", {}).items()),
    ]
    header = "".join(f"# {line}\n" for line in lines)
    return header + OmegaConf.to_yaml(OmegaConf.structured(cluster))
