"""`parakit probe`: measure this machine for the planner (toolkit.config.machine caches the
figures; the default CPU cluster reads them), print them, and write them as a cluster file."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from omegaconf import OmegaConf

from toolkit.config import machine
from toolkit.config.store import compose_config
from toolkit.formats.atomic import write_atomic


def probe_command(opts) -> int:
    """`parakit probe`: measure (again, with --force), print the constants, write the cluster file."""
    try:
        probe = machine.run_probe(force=opts.force)
    except machine.ProbeError as e:
        print(f"parakit probe: {e}", file=sys.stderr)
        return 1
    print(
        f"this machine ({probe['fingerprint']['processor']}, {probe['fingerprint']['cores']} cores), "
        f"measured in {probe['seconds']:.0f} s, cached in {machine.cache_path()}:"
    )
    for field, value in probe["constants"].items():
        print(f"  {field:<26}{value:>12.4g}")
    for backend, costs in probe["stack"].items():
        print(f"  {backend} stack: " + ", ".join(f"{k} {v:.3g}" for k, v in costs.items()))
    target = Path(opts.output) / "cluster" / f"{opts.name}.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, cluster_file(opts.name))
    print(
        f"wrote {target}\nuse it: parakit plan --config-dir {opts.output} cluster={opts.name} ...  "
        "(cluster=cpu uses the same figures while this machine stays as it is)"
    )
    return 0


def cluster_file(name: str) -> str:
    """The default CPU cluster with this machine's measured constants, as a config-group file
    (`cluster=NAME` with --config-dir), its provenance in comments."""
    cluster = dataclasses.replace(compose_config(["cluster=cpu"]).cluster, name=name)
    described = ", ".join(f"{k} {v}" for k, v in machine.fingerprint().items())
    header = f"# {name}: this machine measured by `parakit probe` ({described})\n"
    return header + OmegaConf.to_yaml(OmegaConf.structured(cluster))
