"""Every command the README and docs/ show, as a reader would copy it from a ```bash block:

- the quick ones (`validate`, `generate`, `plan` without --measure, `--version`, `--help`) run as
  shown, in a scratch directory, and exit as shown (0, or N where the line ends `# exits N`);
- the ones that train or measure (`train`, `sweep`, `reproduce`, `probe`, `scale`, `plan --measure`,
  ...) take minutes each: their options are parsed by the command's own parser and every point of
  their configuration (each combination of a sweep's values) is composed and validated as
  `parakit validate` would (the README demo, the recipes and the sweeps are trained by their own
  tests); the GPU and Slurm ones (`# needs a GPU`, `# needs Slurm`) too, which validation needs no
  hardware for;
- a template (`# example`: placeholders such as DIR or `...`) names a command that exists;
- a script (`bash scripts/...`, `python scripts/...`) exists.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from toolkit import cli

ROOT = Path(__file__).parents[1]
GENERATED = {"configuration.md", "commands.md"}  # generated references: tests/test_reference_docs.py
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in GENERATED)]
MARK = re.compile(r"#\s*(needs a GPU|needs Slurm|exits (\d+)|example)\b")
QUICK = {"validate", "generate", "plan"}


def shown_commands() -> list[tuple[str, str, str]]:
    """(where, command line, its mark) for every command of every ```bash block."""
    found = []
    for page in PAGES:
        lines, in_bash, pending, start = page.read_text().splitlines(), False, "", 0
        for number, line in enumerate(lines, 1):
            if line.startswith("```"):
                in_bash = not in_bash and line.strip() == "```bash"
                continue
            if not in_bash or (not pending and (not line.strip() or line.lstrip().startswith("#"))):
                continue
            start = start if pending else number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            command, pending = pending + line, ""
            mark = MARK.search(command)
            found.append((f"{page.relative_to(ROOT)}:{start}", command, mark.group(0) if mark else ""))
    return found


COMMANDS = shown_commands()


def test_the_pages_show_commands():
    assert len(COMMANDS) >= 40, COMMANDS  # the README's tour and the topic pages' commands
    assert any(where.startswith("README.md") for where, _, _ in COMMANDS)


def _words(command: str) -> list[str]:
    words = shlex.split(command, comments=True)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value before the command
        words.pop(0)
    return words


def _sweep_points(overrides: list[str]) -> list[list[str]]:
    """Each combination of a Hydra multirun's values (a,b lists, ranges), as its basic sweeper runs them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [point for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]


def _exits(mark: str) -> int:
    code = re.search(r"exits (\d+)", mark)
    return int(code.group(1)) if code else 0


@pytest.mark.parametrize("where, command, mark", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_shown_command_runs_or_validates(where, command, mark, tmp_path, monkeypatch, capfd):
    words = _words(command)
    assert words, f"{where}: an empty command"
    monkeypatch.chdir(tmp_path)  # what a quick command writes lands here
    if words[0] in ("bash", "python", "source", "."):
        scripts = [w for w in words[1:] if w.startswith(("scripts/", ".ci/", ".venv/"))]
        assert all((ROOT / s).exists() or s.startswith(".venv/") for s in scripts), f"{where}: {command}"
        return
    if words[0] != "parakit":
        return  # another tool's command (wandb sync, mlflow ui, sbatch): theirs to run
    argv = words[1:]
    if argv[:1] == ["--version"] or "--help" in argv or "-h" in argv:
        assert cli.main(argv) == 0, f"{where}: {command}"
        return
    name = " ".join(argv[:2]) if " ".join(argv[:2]) in cli.COMMANDS else argv[0]
    assert name in cli.COMMANDS, f"{where}: no command {name!r} in `{command}`"
    if "example" in mark:
        return
    options = argv[len(name.split()) :]
    spec = cli.COMMANDS[name]
    parser = cli._parser(spec)
    if not spec.hydra:
        parser.parse_args(options)  # argparse exits 2 on an option the command does not have
        return
    opts, overrides = parser.parse_known_args(options)
    if any(not Path(d).expanduser().is_dir() for d in opts.config_dir or ()):
        return  # a folder an earlier command writes (`parakit probe`'s, a sweep's calibration)
    if name in QUICK and not getattr(opts, "measure", None):
        if name == "generate":  # Hydra's job logging reconfigures logging, closing every handler: absl's
            # closes the stream it was given unless it is sys.stderr now, which under pytest's capture it
            # no longer is (the suite's own stderr then). Nothing a user runs has two stderrs.
            argv = [*argv, "hydra/job_logging=none", "hydra/hydra_logging=none"]
            argv += [] if "-m" in argv else [f"hydra.run.dir={tmp_path / 'run'}"]
        assert cli.main(argv) == _exits(mark), f"{where}: {command}\n{capfd.readouterr().err[-3000:]}"
        return
    config_dirs = [f"--config-dir={d}" for d in opts.config_dir or ()]
    overrides = [o for o in overrides if o not in ("-m", "--multirun")]
    points = _scale_points(opts, overrides) if name == "scale" else _sweep_points(overrides)
    codes = [cli.main(["validate", *config_dirs, *point]) for point in points]
    said = capfd.readouterr().err[-3000:]
    if name == "sweep":  # a sweep records the points that do not fit or are invalid (exit 2), and runs the rest
        assert set(codes) <= {0, 2} and 0 in codes, f"{where}: `{command}`: {list(zip(codes, points))}\n{said}"
    else:
        expected = {0, _exits(mark)} if _exits(mark) == 2 else {0}  # validation errors exit 2
        assert set(codes) <= expected, f"{where}: `{command}`: {list(zip(codes, points))}\n{said}"


def _scale_points(opts, overrides: list[str]) -> list[list[str]]:
    """`parakit scale`'s points: the composed layout grown along --dim over --ranks."""
    from toolkit.config.store import compose_config
    from toolkit.report.scale import parse_range, point_overrides

    cfg, (low, high) = compose_config(overrides), parse_range(opts.ranks)
    sizes = [low << k for k in range((high // low).bit_length())]
    return [[*overrides, *point_overrides(cfg, opts.dim, opts.mode, low, ranks)] for ranks in sizes]
