"""`parakit COMMAND [OPTIONS] [hydra overrides]`.

  parakit validate model=llama3_70b cluster=h100_cluster parallel.tp=8 parallel.pp=4
  parakit generate recipe=llama3_8b_8xh100
  parakit generate -m zero=0,1,2,3          # Hydra multirun: one run directory per choice
  parakit plan model=llama3_70b cluster=h100_cluster train.global_batch=512 [--top 10] [--json]
  parakit validate --config-dir ~/team-configs recipe=our_recipe

Each command is a Hydra app over the config search path (the package's conf/, then
--config-dir and $PARAKIT_CONFIG_PATH): overrides, `--cfg job` and multirun work as in any Hydra
program. `COMMAND` is looked up in COMMANDS, whose options are parsed afresh on every call.
Exit codes: 0 ok (warnings allowed), 2 validation errors or a bad option, 1 composition errors
(a wrong type, an unknown key, an unknown group option or a bad config directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import signal
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from toolkit.train.stop import Stopped

# What each data choice trains on, for the summary line (data.path, when set, is named instead).
DATA_DESCRIPTIONS = {
    "corpus": "the bundled King James Bible, GPT-2 BPE",
    "synthetic": "random tokens",
}


@dataclass(frozen=True)
class Option:
    """One command-line option of a command (argparse.add_argument arguments)."""

    flags: tuple[str, ...]
    kwargs: dict
    # What the option names that the command writes, checked before any work (toolkit.formats.output_paths):
    # "folder" (written into), "new_folder" (published whole: must not exist), "prefix" (PREFIX.bin, ...).
    writes: str | None = None


@dataclass(frozen=True)
class Command:
    """One `parakit COMMAND`: what it does, its own options and the function that runs it."""

    name: str
    description: str
    handler: Callable[[object, argparse.Namespace], int]  # (Config, parsed options) -> exit code
    options: tuple[Option, ...] = ()
    writes: bool = False  # writes a run directory (else: no run directory, no log file)
    hydra: bool = True  # composes a configuration from overrides (else: its own options only)
    multirun: bool = False  # always a Hydra multirun: one job per point of the overrides' grid
    # Overrides that come before the user's, from the parsed options (`convert`: model=hf ...).
    compose_with: Callable[[argparse.Namespace], list[str]] | None = None


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"takes a positive whole number, got {text!r}")
    return int(text)


def _number(text: str) -> float:
    """The number `text` says, NaN where it says none (every bound then refuses it)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def _positive_seconds(text: str) -> float:
    value = _number(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"takes a positive number of seconds, got {text!r}")
    return value


def _gain_per_doubling(text: str) -> float:
    """--threshold: the least gain a 2x step must bring; 2 is perfect scaling, so (0, 2]."""
    value = _number(text)
    if not 0 < value <= 2:
        raise argparse.ArgumentTypeError(f"takes a gain per 2x in (0, 2] (2: perfect scaling), got {text!r}")
    return value


CONFIG_DIR = Option(
    ("--config-dir",),
    dict(
        action="append",
        default=[],
        metavar="DIR",
        help="add DIR's config groups (model/, cluster/, recipe/, ...) to the search path; repeatable. "
        "$PARAKIT_CONFIG_PATH (os.pathsep-separated) adds more",
    ),
)


def _data_line(cfg) -> str:
    data = cfg.data
    name = getattr(data.name, "value", data.name)  # an Enum once the schema types it
    if data.path:
        from toolkit.formats.manifest import describe

        return f"data: {name} ({describe(data.path, data.tokenizer)})"
    return f"data: {name} ({DATA_DESCRIPTIONS.get(name, 'see conf/data')})"


def _summary(cfg, layout) -> str:
    c = cfg.cluster
    return (
        f"{cfg.model.name} on {c.name}: {layout.world_size} x {c.gpu} ({c.nodes} node(s) x {c.gpus_per_node}), "
        f"backend {cfg.backend.name}, zero {cfg.zero.stage}, {cfg.precision.dtype}, recompute "
        f"{cfg.recompute.granularity}\n"
        f"layout: {layout.dims.label()}"
        f"{' +sequence-parallel' if cfg.parallel.sequence_parallel else ''}"
        f"{' +tp-comm-overlap' if cfg.parallel.tp_comm_overlap else ''}\n"
        f"batch: global {layout.global_batch} = micro {layout.micro_batch} x accum {layout.grad_accum} x dp "
        f"{layout.dp}; "
        f"seq {layout.seq_length}; {layout.steps} steps; pipeline bubble {layout.bubble_fraction:.1%}\n"
        f"lr {layout.lr:.3g} -> {layout.min_lr:.3g} ({cfg.optim.decay_style}, scaling {cfg.optim.lr_scaling}), "
        f"warmup {layout.warmup_steps} steps\n"
        f"{_data_line(cfg)}"
    )


def _files_of(violations) -> list[str]:
    """Where the fields of `violations` were set when not on the command line: the user's own option
    files (`cluster=mine is /team/cluster/mine.yaml`), so that a team's file is named with its field."""
    from hydra.core.hydra_config import HydraConfig

    from toolkit.config.store import conf_dir

    hc = HydraConfig.get()
    given = {o.split("=", 1)[0].lstrip("+~") for o in hc.overrides.task}
    dirs = [Path(s.path.removeprefix("file://")) for s in hc.runtime.config_sources if s.schema == "file"]
    fields = {f for v in violations for f in v.fields if f not in given}
    notes = []
    for group in sorted({f.split(".")[0] for f in fields if "." in f}):
        option = hc.runtime.choices.get(group)
        files = [d / group / f"{option}.yaml" for d in dirs if d != conf_dir()] if option else []
        notes += [f"  ({group}={option} is {file})" for file in files if file.is_file()]
    return notes


def _checked_layout(command: str, cfg, starts_ranks: bool = False):
    """Validate and print warnings, errors and the summary; the resolved layout, or None on errors.
    `parakit train` on one node checks here, the machine that trains, that it imports the packages
    the options need (and, when it starts the ranks, that it has the cluster's GPUs); elsewhere
    (planning, or a job's other nodes) the summary lists them."""
    from toolkit.config.machine import cuda_gpus
    from toolkit.plan.layout import resolve
    from toolkit.plan.validate import validate

    installed = None
    if command == "train" and cfg.cluster.nodes == 1:
        from toolkit.train.capabilities import importable as installed
    report = validate(cfg, installed=installed, gpus=cuda_gpus() if starts_ranks else None)
    for violation in report.warnings:
        print(violation, file=sys.stderr)
    if not report.ok:
        print(f"parakit {command}: {len(report.errors)} error(s); nothing was generated.", file=sys.stderr)
        for line in [*map(str, report.errors), *_files_of(report.errors)]:
            print(line, file=sys.stderr)
        return None, report
    layout = resolve(cfg)
    print(_summary(cfg, layout))
    if report.packages and installed is None:
        print(report.needs())
    return layout, report


def _refused_without_gpus(command: str, cfg) -> bool:
    """Before a command that trains here starts work: True (and says why) when the cluster's GPUs
    are not on this machine."""
    from toolkit.config.machine import cuda_gpus
    from toolkit.plan.validate import missing_gpus

    refusals = list(missing_gpus(cfg, cuda_gpus()))
    for violation in refusals:
        print(f"parakit {command}: {violation}", file=sys.stderr)
    return bool(refusals)


def _no_timed_steps(command: str, cfg, warmup_steps: int) -> bool:
    """True (and says why) when a profiling run's warm-up would leave no step to time."""
    from toolkit.plan.layout import training_steps

    try:  # before validation: a configuration the validator refuses is its to report
        steps = min(s for s in (training_steps(cfg), cfg.train.stop_after_steps) if s)
    except (ArithmeticError, TypeError, ValueError):
        return False
    if warmup_steps < steps:
        return False
    print(
        f"parakit {command}: --warmup-steps {warmup_steps} leaves no timed step in a run of {steps} step(s): "
        f"give --warmup-steps below {steps}, or train.steps above {warmup_steps}",
        file=sys.stderr,
    )
    return True


def _damaged_record(command: str, sweep_dir: Path) -> bool:
    """Before a sweep, scaling run or measurement adds points: True (and says why) when the folder's
    sweep.json is not a sweep's record."""
    from toolkit.report.sweep import SweepRecordError, read_rows

    try:
        read_rows(sweep_dir)
    except SweepRecordError as e:
        print(f"parakit {command}: {e}", file=sys.stderr)
        return True
    return False


def _validate(cfg, opts) -> int:
    layout, report = _checked_layout("validate", cfg)
    if layout is None:
        return 2
    print("valid" + (f" ({len(report.warnings)} warning(s))" if report.warnings else ""))
    return 0


def _write_run_dir(command: str, cfg, starts_ranks: bool = False):
    """Validate, then write the run files into Hydra's output directory: (layout, dir) or None."""
    from hydra.core.hydra_config import HydraConfig

    from toolkit.emit.files import write_run_files

    if starts_ranks:  # the folders the run itself writes, checked before it writes anything
        from toolkit.formats.output_paths import folder_problem

        given = (("checkpoint.dir", cfg.checkpoint.dir), ("train.save_init_checkpoint", cfg.train.save_init_checkpoint))
        problems = [f"{key}={value}: {problem}" for key, value in given if value and (problem := folder_problem(value))]
        for problem in problems:
            print(f"parakit {command}: {problem}", file=sys.stderr)
        if problems:
            return None
    layout, _ = _checked_layout(command, cfg, starts_ranks)
    if layout is None:
        return None
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    if starts_ranks:
        from toolkit.train.launch import refuse_to_start

        if cfg.checkpoint.dir and not Path(cfg.checkpoint.dir).is_absolute():
            # where the ranks would resolve it, from here; config.yaml records it for the next start
            cfg.checkpoint.dir = str(Path(cfg.checkpoint.dir).absolute())
        refuse_to_start(cfg, out_dir)  # before config.yaml and launch.sh are written over an earlier run's
    for path in write_run_files(cfg, layout, out_dir):
        print(f"wrote {path}")
    return layout, out_dir


def _generate(cfg, opts) -> int:
    return 0 if _write_run_dir("generate", cfg) else 2


def _train(cfg, opts) -> int:
    if opts.verbose:  # the ranks inherit it (toolkit.train.console)
        os.environ["PARAKIT_VERBOSE"] = "1"
    from toolkit.train.checkpoint import ResumeError
    from toolkit.train.launch import dry_run, train_here

    try:
        written = _write_run_dir("train", cfg, starts_ranks=cfg.cluster.nodes == 1 and not opts.dry_run)
        if written is None:
            return 2
        layout, run_dir = written
        if opts.dry_run:
            return dry_run(cfg, layout, run_dir)
        return train_here(cfg, layout, run_dir, detach=opts.detach)
    except ResumeError as e:  # checkpoints this run cannot start with (before any rank, or their conversion)
        print(f"parakit train: {e}", file=sys.stderr)
        return 1


def _data_prepare(cfg, opts) -> int:
    from toolkit.data.prepare import prepare
    from toolkit.data.sources import BadInput
    from toolkit.train.trainer import quiet_upstream_notices

    quiet_upstream_notices()
    try:
        manifest, throughput = prepare(
            [Path(p) for p in opts.inputs],
            Path(opts.output),
            tokenizer_spec=opts.tokenizer,
            text_key=opts.text_key,
            workers=opts.workers,
            skip_bad_lines=opts.skip_bad_lines,
            fmt=opts.format,
            overwrite=opts.overwrite,
        )
    except BadInput as e:
        print(f"parakit data prepare: {e}", file=sys.stderr)
        return 2
    print(f"prepared {opts.output}: {throughput}")
    print(
        f"tokenizer {manifest.tokenizer} ({manifest.tokenizer_class}), vocabulary {manifest.vocab_size:,}, "
        f"end of document {manifest.eod}, ids stored as {manifest.dtype}"
    )
    if manifest.skipped_lines or manifest.empty_documents:
        print(f"skipped {manifest.skipped_lines} bad line(s) and {manifest.empty_documents} document(s) without text")
    print(f"train on it: parakit train data.path={opts.output} model.vocab_size={manifest.vocab_size} ...")
    return 0


def _data_bench(cfg, opts) -> int:
    layout, _ = _checked_layout("data bench", cfg)
    if layout is None:
        return 2
    from toolkit.train.loader_bench import HEADROOM, bench_loader
    from toolkit.train.trainer import quiet_upstream_notices

    quiet_upstream_notices()
    result = bench_loader(cfg, layout, steps=opts.steps)
    print(result.report())
    return 0 if result.ratio >= HEADROOM else 3


def _convert(cfg, opts) -> int:
    from toolkit.formats.hf_arch import HfConfigError
    from toolkit.train.hf_convert import convert_hf_to_megatron
    from toolkit.train.trainer import quiet_upstream_notices

    quiet_upstream_notices()
    try:
        stats = convert_hf_to_megatron(cfg, opts.output)
    except HfConfigError as e:
        print(f"parakit convert hf-to-megatron: {e}", file=sys.stderr)
        return 1
    mib = {k: v / 2**20 for k, v in stats.items() if k.endswith("_bytes")}
    print(
        f"wrote {opts.output}: {cfg.model.name}, {stats['parameters']:,} parameters ({mib['model_bytes']:.1f} MiB); "
        f"largest tensor {mib['largest_tensor_bytes']:.1f} MiB, peak RSS {mib['peak_rss_bytes']:.1f} MiB\n"
        f"start any layout from it: parakit train model=hf model.hf_path={cfg.model.hf_path} "
        f"train.init_checkpoint={opts.output}"
    )
    return 0


def _export(cfg, opts) -> int:
    from toolkit.interop.export import run_export

    return run_export(opts)


def _sweep(cfg, opts) -> int:
    """One point of the sweep (a Hydra job): validated, trained, measured, recorded."""
    from hydra.core.hydra_config import HydraConfig

    from toolkit.report.sweep import main_sweep_summary, run_point

    hc = HydraConfig.get()
    if _refused_without_gpus("sweep", cfg):  # every point would fail the same way: nothing recorded
        return 2
    if _damaged_record("sweep", Path(hc.sweep.dir)) or _no_timed_steps("sweep", cfg, opts.warmup_steps):
        return 1
    if opts.from_plan:
        from toolkit.report.measure import measure_top, measured_table

        sweep_dir = Path(hc.sweep.dir)
        print(measured_table(measure_top(cfg, opts.from_plan, list(hc.overrides.task), sweep_dir, opts.sweep)))
        print(main_sweep_summary(sweep_dir))
        return 0
    row = run_point(cfg, list(hc.overrides.task), Path(hc.runtime.output_dir), Path(hc.sweep.dir), opts.sweep)
    # Hydra's Optuna sweeper maximises the job's return value: measured tokens/s, -inf for a point
    # that did not train (hydra.sweeper.direction=maximize)
    opts.objective = float(row["tokens_per_s"]) if row.get("status") == "ok" and row.get("tokens_per_s") else -math.inf
    opts.sweep_done += 1
    from dataclasses import replace

    from toolkit.report.sweep import progress_line

    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":  # one point per Slurm job: its number, no count
        print(progress_line(row, hc.job.num + 1, replace(opts.sweep, total_points=None)), flush=True)
    else:
        print(progress_line(row, opts.sweep_done, opts.sweep), flush=True)
    return 0  # a failed point is recorded, never the sweep's failure


def _recipe_layout(cfg) -> str:
    """The composed layout as a --layouts name (tp2_pp2_vpp2)."""
    from toolkit.plan.parallel_dims import ParallelDims

    return ParallelDims.of(cfg.parallel, dp=cfg.parallel.dp or 1).short()


def _reproduce(cfg, opts) -> int:
    from hydra.core.hydra_config import HydraConfig

    from toolkit.config.store import search_path
    from toolkit.reproduce.run import reproduce

    hc = HydraConfig.get()
    recipe = hc.runtime.choices.get("recipe")
    dirs = search_path(opts.config_dir)
    if opts.layouts or opts.backends:
        from toolkit.reproduce.layouts import reproduce_layouts

        if not recipe or recipe == "null" or opts.record:
            print("parakit reproduce: --layouts/--backends take a recipe=NAME and no --record", file=sys.stderr)
            return 2
        if _refused_without_gpus("reproduce", cfg):
            return 2
        opts.layouts = opts.layouts or _recipe_layout(cfg)
        opts.backends = opts.backends or str(cfg.backend.name)
        return reproduce_layouts(cfg, opts, recipe, list(hc.overrides.task), Path(hc.runtime.output_dir))
    return reproduce(cfg, opts, recipe, list(hc.overrides.task), dirs, _reproduce_run_dir)


def _reproduce_run_dir(cfg):
    """`parakit reproduce`'s run files, as `parakit train` writes them: (layout, dir) or None."""
    from toolkit.train.checkpoint import ResumeError

    try:
        return _write_run_dir("reproduce", cfg, True)
    except ResumeError as e:
        print(f"parakit reproduce: {e}", file=sys.stderr)
        return None


def _name(text: str) -> str:
    """A --name that becomes CONFIG_DIR/cluster/NAME.yaml and `cluster=NAME`: a name, never a path."""
    from toolkit.config.schema import NAME, NAME_RULE

    if not re.fullmatch(NAME, text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a name: use {NAME_RULE} (it names the file cluster/NAME.yaml and the option cluster=NAME)"
        )
    return text


def _cluster_name(text: str) -> str:
    """--name of a cluster file parakit writes (probe, calibrate): a name, and not one of the shipped
    clusters, which an option of the same name in --config-dir may not replace (config.store)."""
    from toolkit.config.store import conf_dir

    name = _name(text)
    if (conf_dir() / "cluster" / f"{name}.yaml").exists():
        raise argparse.ArgumentTypeError(
            f"{name!r} is one of parakit's own clusters (cluster={name}), which a cluster file of that name cannot "
            f"replace: choose another, e.g. {name}_probed"
        )
    return name


def _probe(cfg, opts) -> int:
    from toolkit.report.probe import probe_command

    return probe_command(opts)


def _calibrate(cfg, opts) -> int:
    from toolkit.report.calibrate import run_calibrate

    return run_calibrate(opts)


def _scale(cfg, opts) -> int:
    from hydra.core.hydra_config import HydraConfig

    from toolkit.report.scale import scale_command

    if _refused_without_gpus("scale", cfg):
        return 2
    if _no_timed_steps("scale", cfg, opts.warmup_steps):
        return 1
    return scale_command(cfg, opts, list(HydraConfig.get().overrides.task))


def _report(cfg, opts) -> int:
    from toolkit.report.page import report_command

    return report_command(opts)


def _plan(cfg, opts) -> int:
    from toolkit.plan.report import plan_command

    if problem := _plan_mode_problem(opts):
        print(f"parakit plan: {problem}", file=sys.stderr)
        return 2
    if opts.scaling:
        from toolkit.plan.scaling import curve_table, predicted_curve
        from toolkit.report.scale import parse_range

        try:
            low, high = parse_range(opts.scaling)
            curve = predicted_curve(cfg, low, high, opts.scaling_mode)
        except ValueError as e:  # ScaleError too
            print(f"parakit plan --scaling: {e}", file=sys.stderr)
            return 2
        if opts.json:
            import json

            from toolkit.plan.doublings import doublings

            steps = [dataclasses.asdict(d) for d in doublings(curve, opts.threshold)]
            shape = {"mode": opts.scaling_mode, "model": cfg.model.name, "cluster": cfg.cluster.name}
            print(json.dumps({**shape, "threshold": opts.threshold, "points": curve, "doublings": steps}, indent=2))
            return 0
        print(f"{opts.scaling_mode} scaling of {cfg.model.name} on {cfg.cluster.name}, the best layout at each size:")
        print(curve_table(curve, opts.threshold))
        return 0
    if not opts.measure:
        code = plan_command(cfg, top=opts.top, as_json=opts.json)
        if code:
            from toolkit.plan.validate import validate

            for note in _files_of(validate(cfg, memory=False).errors):
                print(note, file=sys.stderr)
        return code
    if _refused_without_gpus("plan --measure", cfg):
        return 2
    from hydra.core.hydra_config import HydraConfig

    from toolkit.config.schema import as_name
    from toolkit.plan.layout import world_size
    from toolkit.report.measure import measure_top, measured_table
    from toolkit.report.sweep import SweepOptions

    code = plan_command(cfg, top=opts.top, as_json=False)
    if code:
        return code
    folder = f"{as_name(cfg.model.name)}-{as_name(cfg.cluster.name)}-{world_size(cfg)}"
    sweep_dir = Path(opts.sweep_dir or f"plan-measure/{folder}")
    if _damaged_record("plan --measure", sweep_dir) or _no_timed_steps("plan --measure", cfg, opts.warmup_steps):
        return 1
    print(f"\nmeasuring the top {opts.measure} in {sweep_dir} (a short profiling run each):", flush=True)
    sweep = SweepOptions(opts.warmup_steps, opts.timeout)
    measured = measure_top(cfg, opts.measure, list(HydraConfig.get().overrides.task), sweep_dir, sweep)
    print("\nthe top layouts re-ranked by measured throughput (error: predicted over measured):")
    print(measured_table(measured))
    if not any(row.get("tokens_per_s") for _, _, row in measured):
        print(f"parakit plan --measure: no layout was measured (their logs: {sweep_dir})", file=sys.stderr)
        return 1
    return 0


WARMUP_STEPS, POINT_TIMEOUT_S, GAIN_PER_DOUBLING, SCALING_MODE = 2, 900.0, 1.6, "weak"
SWEEP_OPTIONS = (
    Option(("--warmup-steps",), dict(type=int, default=WARMUP_STEPS, metavar="N", help="untimed steps (default 2)")),
    Option(
        ("--timeout",),
        dict(
            type=_positive_seconds, default=POINT_TIMEOUT_S, metavar="S", help="seconds a point may run (default 900)"
        ),
    ),
)
THRESHOLD = Option(
    ("--threshold",),
    dict(type=_gain_per_doubling, default=GAIN_PER_DOUBLING, metavar="X", help="gain per 2x (default 1.6)"),
)
# `plan`'s options of one mode (--measure's runs, --scaling's curve) have no default there, so that
# one given without its mode is refused instead of ignored (_plan_mode_problem)
MEASURE_ONLY = {"warmup_steps": WARMUP_STEPS, "timeout": POINT_TIMEOUT_S, "sweep_dir": None}
SCALING_ONLY = {"scaling_mode": SCALING_MODE, "threshold": GAIN_PER_DOUBLING}


def _of_mode(option: Option, mode: str) -> Option:
    """`plan`'s copy of a shared option that only one of its modes uses: no default (said in its help)."""
    return dataclasses.replace(
        option, kwargs={**option.kwargs, "default": None, "help": f"with {mode}: {option.kwargs['help']}"}
    )


PLAN_MODE_OPTIONS = (
    *(_of_mode(option, "--measure") for option in SWEEP_OPTIONS),
    Option(
        ("--sweep-dir",),
        dict(metavar="DIR", help="with --measure: where it records (default: plan-measure/MODEL-CLUSTER-GPUS)"),
    ),
    Option(("--scaling",), dict(metavar="A..B", help="predicted scaling curve over A..B GPUs, e.g. 8..16384")),
    Option(("--scaling-mode",), dict(choices=("weak", "strong"), help="with --scaling: default weak")),
    _of_mode(THRESHOLD, "--scaling"),
)


def _plan_mode_problem(opts) -> str | None:
    """Why `plan`'s options do not go together (--measure with --scaling, an option of one without
    it), or None; fills in the defaults of the mode chosen."""
    if opts.scaling and opts.measure:
        return "--measure trains the top layouts at one size and --scaling predicts a curve over sizes: give one"
    for mode, flag, options in (("measure", "--measure K", MEASURE_ONLY), ("scaling", "--scaling A..B", SCALING_ONLY)):
        given = [f"--{name.replace('_', '-')}" for name in options if getattr(opts, name) is not None]
        if given and not getattr(opts, mode):
            verb, pronoun = ("shapes", "it") if len(given) == 1 else ("shape", "them")
            return f"{', '.join(given)} only {verb} {flag}: add {flag}, or drop {pronoun}"
        for name, default in options.items():
            setattr(opts, name, default if getattr(opts, name) is None else getattr(opts, name))
    if opts.json and opts.measure:
        return "--measure prints its measured table, not JSON: drop --json"
    return None


COMMANDS = {
    c.name: c
    for c in (
        Command("validate", "check a composed configuration; print every error and warning with its fix", _validate),
        Command(
            "generate",
            "validate, then write config.yaml, deepspeed.json, megatron.yaml, megatron_args.txt and launch.sh "
            "into the Hydra run directory",
            _generate,
            writes=True,
        ),
        Command(
            "plan",
            "search every valid layout for the model on the cluster, drop those that do not fit, rank the rest "
            "by predicted throughput",
            _plan,
            options=(
                Option(("--top",), dict(type=_positive_int, default=10, metavar="N", help="layouts to list")),
                Option(("--json",), dict(action="store_true", help="print JSON for machines")),
                Option(
                    ("--measure",),
                    dict(
                        type=_positive_int,
                        metavar="K",
                        help="train the top K for a short profiling run each and re-rank them by measured tokens/s",
                    ),
                ),
                *PLAN_MODE_OPTIONS,
            ),
        ),
        Command(
            "data prepare",
            "tokenize jsonl, text or parquet files into a Megatron indexed dataset (PREFIX.bin/.idx) with the "
            "tokenizer's files and a manifest, for data.path=PREFIX",
            _data_prepare,
            hydra=False,
            options=(
                Option(("inputs",), dict(nargs="+", metavar="INPUT", help="input files (.jsonl, .txt, .parquet)")),
                Option(
                    ("--output",), dict(required=True, metavar="PREFIX", help="writes PREFIX.bin, .idx, ..."), "prefix"
                ),
                Option(
                    ("--tokenizer",),
                    dict(default="gpt2", metavar="DIR", help="a Hugging Face tokenizer directory, or gpt2 (bundled)"),
                ),
                Option(("--text-key",), dict(default="text", metavar="KEY", help="the text field (jsonl, parquet)")),
                Option(("--workers",), dict(type=_positive_int, default=1, metavar="N", help="tokenizer processes")),
                Option(("--skip-bad-lines",), dict(action="store_true", help="count and skip bad lines")),
                Option(("--format",), dict(choices=["jsonl", "text", "parquet"], help="default: by file extension")),
                Option(("--overwrite",), dict(action="store_true", help="replace a dataset prepared at PREFIX")),
            ),
        ),
        Command(
            "data bench",
            "measure the samples/s one rank's data loader supplies for the configuration and compare them with "
            "what the planned GPUs consume (exit 3 when the loader would starve them)",
            _data_bench,
            options=(Option(("--steps",), dict(type=_positive_int, default=20, metavar="N", help="steps to time")),),
        ),
        Command(
            "export",
            "write a run's checkpoint (megatron at any layout, DeepSpeed ZeRO 0-3 or pipeline) as a Hugging Face "
            "directory: safetensors shards, config.json, tokenizer files",
            _export,
            hydra=False,
            options=(
                Option(("path",), dict(metavar="RUN_DIR_OR_CHECKPOINT", help="a run, its checkpoints/, a step")),
                Option(
                    ("--output", "-o"),
                    dict(required=True, metavar="HF_DIR", help="written whole; must not exist"),
                    "new_folder",
                ),
                Option(("--step",), dict(type=_positive_int, metavar="N", help="default: the newest intact one")),
                Option(("--config",), dict(metavar="FILE", help="the run's config.yaml (default: found beside PATH)")),
                Option(("--tokenizer",), dict(metavar="DIR", help="tokenizer to ship (default: the training data's)")),
                Option(("--no-tokenizer",), dict(action="store_true", help="weights and configs only")),
                Option(("--max-shard-size",), dict(default="5GB", metavar="SIZE", help="e.g. 500MB (default: 5GB)")),
            ),
        ),
        Command(
            "scale",
            "measure a scaling curve: from the composed layout, double one dimension at a time (weak: batch per "
            "data-parallel rank fixed; strong: global batch fixed), record tokens/s and the gain of each doubling, "
            "and say where a doubling gains under the threshold",
            _scale,
            options=(
                Option(
                    ("--dim",), dict(choices=("dp", "tp", "pp", "ep"), default="dp", help="the dimension to double")
                ),
                Option(("--mode",), dict(choices=("weak", "strong"), default="weak", help="default: weak")),
                Option(("--ranks",), dict(default="1..4", metavar="START..END", help="powers of two (default 1..4)")),
                THRESHOLD,
                *SWEEP_OPTIONS,
                Option(("--sweep-dir",), dict(metavar="DIR", help="default: scale/MODEL-DIM-MODE")),
            ),
        ),
        Command(
            "probe",
            "measure this machine for the planner: matrix multiplies over the shapes models use, memory "
            "bandwidth, gloo collectives among local ranks, each backend's per-layer and per-step costs; "
            "cached for the default cpu cluster (re-measured when the machine changes) and written as a "
            "cluster file usable as cluster=NAME",
            _probe,
            hydra=False,
            options=(
                Option(("--force",), dict(action="store_true", help="measure again even if this machine is cached")),
                Option(
                    ("--output", "-o"), dict(default="probe", metavar="CONFIG_DIR", help="default: ./probe"), "folder"
                ),
                Option(
                    ("--name",),
                    dict(default="this_machine", type=_cluster_name, metavar="NAME", help="default: this_machine"),
                ),
            ),
        ),
        Command(
            "calibrate",
            "fit the cluster's efficiency constants (GEMM efficiency, bandwidths, per-step overhead) to a measured "
            "sweep by least squares; print the step-time error on held-out points before and after; write the "
            "fitted cluster as a config file usable as cluster=NAME",
            _calibrate,
            hydra=False,
            options=(
                Option(("sweep_dir",), dict(metavar="SWEEP_DIR", help="a `parakit sweep` directory (sweep.json)")),
                Option(("--output", "-o"), dict(metavar="CONFIG_DIR", help="default: SWEEP_DIR/calibrated"), "folder"),
                Option(("--name",), dict(type=_cluster_name, metavar="NAME", help="default: CLUSTER_calibrated")),
            ),
        ),
        Command(
            "sweep",
            "train each point of a grid of overrides (Hydra's multirun syntax: parallel.tp=1,2 zero=0,1) for a "
            "short profiling run; record measured and predicted step time, tokens/s, MFU and memory in "
            "sweep.csv and sweep.json under hydra.sweep.dir (a re-run skips recorded points)",
            _sweep,
            writes=True,
            multirun=True,
            options=(
                *SWEEP_OPTIONS,
                Option(
                    ("--from-plan",),
                    dict(
                        type=_positive_int,
                        metavar="K",
                        help="sweep the planner's top K layouts for the composed model and cluster instead of a grid",
                    ),
                ),
            ),
        ),
        Command(
            "report",
            "DIR: plots (throughput vs ranks, efficiency per doubling, predicted vs measured, loss curves, time "
            "per pipeline stage), one self-contained HTML page and a Markdown table, from a sweep, a scaling run "
            "or one training run directory",
            _report,
            hydra=False,
            options=(
                Option(("dir",), dict(metavar="DIR", help="a sweep or scaling directory (sweep.json) or a run")),
                Option(
                    ("--output", "-o"),
                    dict(metavar="OUT", help="where the report goes (default: DIR/report)"),
                    "folder",
                ),
            ),
        ),
        Command(
            "reproduce",
            "recipe=NAME: run the recipe and compare it with its baseline (the loss at every step against the "
            "golden curve; throughput and peak memory on the same hardware); exit 1 when they differ. --record "
            "writes the baseline. A GPU recipe on a machine without GPUs prints its published figure beside the "
            "planner's prediction",
            _reproduce,
            writes=True,
            options=(
                Option(
                    ("--steps",),
                    dict(
                        type=_positive_int,
                        metavar="K",
                        help="stop after K steps (the schedule still spans the recipe's steps) and compare those",
                    ),
                ),
                Option(
                    ("--layouts",),
                    dict(
                        metavar="L1,L2,...",
                        help="train the recipe in each layout (tp2_pp2_vpp2,pp4_vpp2,dp4: sizes joined by _) from the "
                        "same initial weights and compare the curves",
                    ),
                ),
                Option(
                    ("--backends",),
                    dict(metavar="B1,B2", help="with --layouts: megatron,deepspeed (default: the recipe's backend)"),
                ),
                Option(("--record",), dict(action="store_true", help="write the run as the recipe's baseline")),
                Option(("--force",), dict(action="store_true", help="with --record: replace a different baseline")),
            ),
            compose_with=lambda o: [f"train.stop_after_steps={o.steps}"] if o.steps else [],
        ),
        Command(
            "train",
            "validate, generate the run directory, then train: in this process for one rank, through torchrun "
            "for several (cluster.gpus_per_node ranks on this machine); on several nodes (cluster.nodes) submit "
            "launch.sh to Slurm and follow the job's logs",
            _train,
            options=(
                Option(
                    ("--dry-run",),
                    dict(
                        action="store_true", help="write the run directory and print the launch command; start nothing"
                    ),
                ),
                Option(
                    ("--detach",),
                    dict(action="store_true", help="several nodes: submit the job and return (do not follow its logs)"),
                ),
                Option(
                    ("--verbose",),
                    dict(
                        action="store_true",
                        help="show other libraries' INFO logs and prints on the console too (always in the run's "
                        "parakit.log and logs/rankR.log)",
                    ),
                ),
            ),
            writes=True,
        ),
        Command(
            "convert hf-to-megatron",
            "HF_DIR --output DIR: write a Hugging Face model directory as a megatron-core dist checkpoint that "
            "train.init_checkpoint loads at any tp/pp/vpp (model=hf model.hf_path=HF_DIR)",
            _convert,
            options=(
                Option(("hf_dir",), dict(metavar="HF_DIR", help="a local Hugging Face model directory")),
                Option(
                    ("--output",),
                    dict(
                        required=True, metavar="DIR", help="where the checkpoint goes (written whole; must not exist)"
                    ),
                    "new_folder",
                ),
            ),
            compose_with=lambda o: ["model=hf", f"model.hf_path={Path(o.hf_dir).resolve()}"],
        ),
    )
}


def _usage() -> str:
    lines = ["usage: parakit COMMAND [OPTIONS] [OVERRIDES...]", "       parakit --version", "", "commands:"]
    for c in COMMANDS.values():
        lines += textwrap.wrap(c.description, 90, initial_indent=f"  {c.name:<13} ", subsequent_indent=" " * 16)
    lines += [
        "",
        "overrides are Hydra's: model=llama3_8b cluster=8xh100 parallel.tp=8 zero=1 precision=bf16",
        "recompute=selective backend=megatron train.global_batch=512 recipe=NAME",
        "`parakit COMMAND --help` lists the command's options and every config group with its choices.",
    ]
    return "\n".join(lines)


def _parser(command: Command) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"parakit {command.name}",
        usage=f"parakit {command.name} [OPTIONS] [OVERRIDES...]" if command.hydra else None,
        description=command.description,
        add_help=False,
        allow_abbrev=False,  # `-m` and other Hydra flags pass through untouched
    )
    parser.add_argument(
        "-h", "--help", action="store_true", help="show this help" + (": options and config groups" * command.hydra)
    )
    for option in (*command.options, CONFIG_DIR) if command.hydra else command.options:
        parser.add_argument(*option.flags, **option.kwargs)
    return parser


def command_reference() -> str:
    """Every command's usage, description and options as `--help` prints them (at 100 columns):
    docs/commands.md (scripts/gen_reference_docs.py writes it); a test keeps it current."""
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width
    try:
        sections = [
            f"## `parakit {c.name}`\n\n```\n{_parser(c).format_help().rstrip()}\n```" for c in COMMANDS.values()
        ]
    finally:
        if columns is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = columns
    intro = (
        "# Command reference\n\nGenerated from parakit's argument parsers by `python scripts/gen_reference_docs.py`; "
        "tests/test_reference_docs.py fails when it is out of date. Every command that composes a "
        "configuration also takes Hydra overrides (docs/configuration.md lists the fields), and its "
        "`--help` lists the config groups with their choices.\n"
    )
    return intro + "\n" + "\n\n".join(sections) + "\n"


def _help(parser: argparse.ArgumentParser, dirs: list[Path]) -> str:
    from toolkit.config.store import group_options

    lines = [
        parser.format_help().rstrip(),
        "",
        "Hydra's flags work as in any Hydra app: --cfg job, -m/--multirun, --info, --hydra-help.",
        "",
        "config groups (GROUP=OPTION; any field as GROUP.FIELD=VALUE):",
    ]
    for group, names in group_options(dirs).items():
        lines += textwrap.wrap(", ".join(names), 100, initial_indent=f"  {group:<11} ", subsequent_indent=" " * 14)
    lines += ["", "config search path: " + ", ".join(str(d) for d in dirs)]
    return "\n".join(lines)


def _group_help(argv: list[str]) -> int:
    """`parakit data`, `parakit convert --help`: the sub-commands of a first word (exit 0 when help was
    asked for, 2 otherwise); any other unknown word: the usage, exit 2."""
    group = [c for c in COMMANDS.values() if c.name.split()[0] == argv[0] and " " in c.name]
    if not group:
        print(f"parakit: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    lines = [f"usage: parakit {argv[0]} SUBCOMMAND [OPTIONS]", "", "subcommands:"]
    for c in group:
        lines += textwrap.wrap(c.description, 90, initial_indent=f"  {c.name:<24} ", subsequent_indent=" " * 27)
    lines += ["", f"`parakit {argv[0]} SUBCOMMAND --help` lists the subcommand's options."]
    if argv[1:2] in (["-h"], ["--help"]):
        print("\n".join(lines))
        return 0
    problem = f"unknown subcommand {argv[1]!r}" if argv[1:] else "a subcommand is needed"
    print(f"parakit {argv[0]}: {problem}\n\n" + "\n".join(lines), file=sys.stderr)
    return 2


def _output_problems(command: Command, opts: argparse.Namespace, overrides: list[str]) -> list[str]:
    """What the command would write that cannot be written: its output options, the run or sweep
    folder an override gives Hydra (one without interpolations: Hydra resolves those), and an
    override holding a password."""
    from toolkit.config.secrets import credentials_fix, has_password, masked
    from toolkit.formats.output_paths import file_problem, folder_problem

    problems = []
    for option in command.options:
        value = getattr(opts, option.flags[0].lstrip("-").replace("-", "_"), None)
        if option.writes and value is not None:
            check = {
                "folder": lambda v: folder_problem(v),
                "new_folder": lambda v: folder_problem(v, new=True),
                "prefix": lambda v: file_problem(f"{v}.bin"),
            }[option.writes]
            if problem := check(value):
                problems.append(f"{option.flags[0]} {value}: {problem}")
    for override in overrides:
        key, _, value = override.partition("=")
        if has_password(value):  # before Hydra writes the overrides into .hydra/ (the validator: config files)
            problems.append(
                f"{key.lstrip('+~')}={masked(value)}: holds a password (user:password@), which would be written "
                f"into the run's files and log. Fix: {credentials_fix(key.lstrip('+~'))}"
            )
        if key in ("hydra.run.dir", "hydra.sweep.dir") and value and "${" not in value:
            if problem := folder_problem(value.strip("'\"")):
                problems.append(f"{key}={value}: {problem}")
    return problems


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("parakit")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _run_hydra_app(command: Command, opts: argparse.Namespace, args: list[str]) -> int:
    """Compose with Hydra (single run or multirun) and run the command's handler on each config."""
    import hydra

    from toolkit.config.store import hydra_overrides, register_schema, search_path, to_config
    from toolkit.formats.hf_arch import HfConfigError

    dirs = search_path(opts.config_dir)
    overrides = hydra_overrides([*(command.compose_with(opts) if command.compose_with else []), *args], dirs)
    if not command.writes:
        user_keys = {o.split("=", 1)[0].lstrip("+~") for o in args}
        extra = ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=none", "hydra/hydra_logging=none"]
        overrides += [o for o in extra if o.split("=", 1)[0] not in user_keys]
    if command.multirun:
        from toolkit.report.sweep import SweepOptions, errors_in_every_point, grid_size, register_point_dirs
        from toolkit.report.sweep_slurm import launcher_problem

        if problem := launcher_problem(args):
            print(f"parakit {command.name}: {problem}", file=sys.stderr)
            return 1
        given = [o.partition("=")[2].strip("'\"") for o in args if o.startswith("hydra.sweep.dir=")]
        if given and "${" not in given[-1] and _damaged_record(command.name, Path(given[-1])):
            return 1  # before Hydra writes its multirun.yaml and the points' folders there

        if command.name == "sweep" and not opts.from_plan and (errors := errors_in_every_point(args, opts.config_dir)):
            print(
                f"parakit {command.name}: every point of the sweep has these errors; nothing was started:",
                file=sys.stderr,
            )
            print("\n".join(f"  {e}" for e in errors), file=sys.stderr)
            return 2
        opts.sweep = SweepOptions(opts.warmup_steps, opts.timeout, grid_size(args), time.time())
        opts.sweep_done = 0
        if opts.from_plan:  # one composition; its points come from the planner, not a grid
            overrides.append("hydra.run.dir=${hydra.sweep.dir}")
        else:
            register_point_dirs()
            overrides = ["--multirun", *overrides]
            if not any(o.startswith("hydra.sweep.subdir=") for o in args):
                overrides.append("hydra.sweep.subdir='${point_dir:${hydra.job.override_dirname}}'")
    register_schema()
    codes = [0]  # one per job: a multirun exits with the worst

    def task(cfg_node) -> int:
        from toolkit.train.console import quiet_console

        quiet_console()  # after Hydra's job logging: other libraries' INFO to the run's log file only
        try:
            cfg = to_config(cfg_node)
        except HfConfigError as e:  # a bad model.hf_path under model=hf: one line, no traceback
            print(f"parakit {command.name}: {e}", file=sys.stderr)
            code = 1
        else:
            code = command.handler(cfg, opts)
        codes.append(code)
        if command.multirun and hasattr(opts, "objective"):  # a sweep point: what a sweeper maximises
            return opts.objective
        return code  # a job run elsewhere (a Slurm job) appends to its own copy of codes: this comes back

    task.exit_codes = codes  # parakit's Slurm launcher adds the codes that come back from its jobs here
    app = hydra.main(config_path=str(dirs[0]), config_name="config", version_base="1.3")(task)

    saved_argv = sys.argv
    sys.argv = [f"parakit {command.name}", *overrides]  # hydra.main reads its arguments from sys.argv
    try:
        app()
    finally:
        sys.argv = saved_argv
    return max(codes)


def main(argv: list[str] | None = None) -> int:
    """Run `parakit COMMAND ...` and return its exit code; nothing outlives the call."""
    from toolkit.config.store import SearchPathError, UnknownOptionError, search_path

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        print(f"parakit {_version()}")
        return 0
    words = 2 if " ".join(argv[:2]) in COMMANDS else 1  # `data prepare`: a command of two words
    command = COMMANDS.get(" ".join(argv[:words]))
    if command is None:
        return _group_help(argv)
    parser = _parser(command)
    asks_help = "-h" in argv[words:] or "--help" in argv[words:]
    try:
        if not command.hydra:
            if asks_help:
                print(parser.format_help().rstrip())
                return 0
            opts = parser.parse_args(argv[words:])
            if problems := _output_problems(command, opts, []):
                print("\n".join(f"parakit {command.name}: {p}" for p in problems), file=sys.stderr)
                return 1
            return command.handler(None, opts)
        if asks_help:  # before parsing: a required positional (convert's HF_DIR) must not turn --help into exit 2
            config_dirs = _parser(Command(command.name, "", None)).parse_known_args(argv[words:])[0].config_dir
            print(_help(parser, search_path(config_dirs)))
            return 0
        opts, rest = parser.parse_known_args(argv[words:])
        if problems := _output_problems(command, opts, rest):
            print("\n".join(f"parakit {command.name}: {p}" for p in problems), file=sys.stderr)
            return 1
        return _run_hydra_app(command, opts, rest)
    except (SearchPathError, UnknownOptionError) as e:
        print(f"parakit {command.name}: {e}", file=sys.stderr)
        return 1
    except SystemExit as e:  # argparse (bad option: 2) and Hydra (composition error: 1) exit
        return e.code if isinstance(e.code, int) else 1
    except (Stopped, KeyboardInterrupt) as e:  # what it started has ended (toolkit.train.stop)
        stopped = e if isinstance(e, Stopped) else Stopped(signal.SIGINT)
        print(f"parakit {command.name}: {stopped}; every process it started has ended", file=sys.stderr, flush=True)
        return stopped.exit_code


if __name__ == "__main__":
    sys.exit(main())
