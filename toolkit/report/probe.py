"""`parakit probe`: measure this machine for the planner (toolkit.config.machine caches the
figures; the default CPU cluster reads them), print them, and write them as a cluster file."""

from __future__ import annotations

import sys
from pathlib import Path

from toolkit.config import machine
from toolkit.emit.files import write_atomic


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
    write_atomic(target, machine.cluster_file(opts.name))
    print(
        f"wrote {target}\nuse it: parakit plan --config-dir {opts.output} cluster={opts.name} ...  "
        "(cluster=cpu uses the same figures while this machine stays as it is)"
    )
    return 0
