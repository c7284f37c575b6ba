"""`parakit COMMAND [hydra overrides]`.

  parakit validate model=llama3_70b cluster=h100_cluster parallel.tp=8 parallel.pp=4
  parakit generate recipe=llama3_8b_8xh100
  parakit generate -m zero=0,1,2,3          # Hydra multirun: one run directory per choice
  parakit plan model=llama3_70b cluster=h100_cluster train.global_batch=512 [--top 10] [--json]

Each command is a Hydra app over conf/: overrides, `--cfg job`, `--help` and multirun work as
in any Hydra program. Exit codes: 0 ok (warnings allowed), 2 validation errors, 1 composition
errors (a wrong type, an unknown key or group option; Hydra prints which).
"""

from __future__ import annotations

import sys
from pathlib import Path

USAGE = """usage: parakit COMMAND [OVERRIDES...]

commands:
  validate   check a composed configuration; print every error and warning with its fix
  generate   validate, then write config.yaml, deepspeed.json, megatron.yaml,
             megatron_args.txt and launch.sh into the Hydra run directory
  plan       search every valid layout for the model on the cluster, drop those that do not
             fit, rank the rest by predicted throughput (--top N, --json for machines)
  train      validate, generate the run directory, then train: in this process for one
             rank, through torchrun for several (cluster.gpus_per_node ranks on this machine)

overrides are Hydra's: model=llama3_8b cluster=8xh100 parallel.tp=8 zero=1 precision=bf16
recompute=selective backend=megatron train.global_batch=512 recipe=NAME (see conf/ and recipes/)
"""

_exit_code = 0
_plan_options = {"top": 10, "as_json": False}


def _summary(cfg, layout) -> str:
    c = cfg.cluster
    return (
        f"{cfg.model.name} on {c.name}: {layout.world_size} x {c.gpu} ({c.nodes} node(s) x {c.gpus_per_node}), "
        f"backend {cfg.backend.name}, zero {cfg.zero.stage}, {cfg.precision.dtype}, recompute "
        f"{cfg.recompute.granularity}\n"
        f"layout: tp={layout.tp} pp={layout.pp} vpp={layout.vpp} cp={layout.cp} dp={layout.dp}"
        f"{' +sequence-parallel' if cfg.parallel.sequence_parallel else ''}\n"
        f"batch: global {layout.global_batch} = micro {layout.micro_batch} x accum {layout.grad_accum} x dp "
        f"{layout.dp}; "
        f"seq {layout.seq_length}; {layout.steps} steps; pipeline bubble {layout.bubble_fraction:.1%}\n"
        f"lr {layout.lr:.3g} -> {layout.min_lr:.3g} ({cfg.optim.decay_style}, scaling {cfg.optim.lr_scaling}), "
        f"warmup {layout.warmup_steps} steps"
    )


def _run(command: str, cfg_node) -> int:
    from hydra.core.hydra_config import HydraConfig

    from toolkit.config.store import to_config
    from toolkit.plan.layout import resolve
    from toolkit.plan.validate import validate

    cfg = to_config(cfg_node)
    if command == "plan":
        from toolkit.plan.report import plan_command

        return plan_command(cfg, **_plan_options)
    report = validate(cfg)
    for violation in report.warnings:
        print(violation, file=sys.stderr)
    if not report.ok:
        print(f"parakit {command}: {len(report.errors)} error(s); nothing was generated.", file=sys.stderr)
        for violation in report.errors:
            print(violation, file=sys.stderr)
        return 2
    layout = resolve(cfg)
    print(_summary(cfg, layout))
    if command in ("generate", "train"):
        from toolkit.emit.files import write_run_files

        out_dir = Path(HydraConfig.get().runtime.output_dir)
        for path in write_run_files(cfg, layout, out_dir):
            print(f"wrote {path}")
        if command == "train":
            from toolkit.train.launch import train_here

            return train_here(cfg, layout, out_dir)
    else:
        print("valid" + (f" ({len(report.warnings)} warning(s))" if report.warnings else ""))
    return 0


def _take_plan_options(args: list[str]) -> list[str] | None:
    """Strip `--json` and `--top N` (plan's own options) from the Hydra overrides."""
    rest, it = [], iter(args)
    for arg in it:
        if arg == "--json":
            _plan_options["as_json"] = True
        elif arg == "--top" or arg.startswith("--top="):
            value = arg.split("=", 1)[1] if "=" in arg else next(it, "")
            if not value.isdigit() or int(value) < 1:
                print(f"parakit plan: --top takes a positive whole number, got {value!r}", file=sys.stderr)
                return None
            _plan_options["top"] = int(value)
        else:
            rest.append(arg)
    return rest


def main(argv: list[str] | None = None) -> int:
    global _exit_code
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, overrides = argv[0], argv[1:]
    if command == "plan":
        overrides = _take_plan_options(overrides)
        if overrides is None:
            return 2
    if command not in ("validate", "generate", "plan", "train"):
        print(f"parakit: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2

    import hydra

    from toolkit.config.store import conf_dir, quote_numeric_choices, register_schema

    register_schema()
    extra = []
    if command in ("validate", "plan"):  # these write nothing: no run directory, no log file
        extra = ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    user_keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    extra = [o for o in extra if o.split("=", 1)[0] not in user_keys]

    @hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
    def app(cfg_node) -> None:
        global _exit_code
        _exit_code = max(_exit_code, _run(command, cfg_node))

    _exit_code = 0
    saved_argv = sys.argv
    sys.argv = [f"parakit {command}", *quote_numeric_choices(overrides), *extra]
    try:
        app()
    finally:
        sys.argv = saved_argv
    return _exit_code


if __name__ == "__main__":
    sys.exit(main())
