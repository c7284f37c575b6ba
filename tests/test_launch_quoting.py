"""No config value reaches a shell: hostile values ($(...), backticks, ';', newlines, spaces, quotes,
globs) in every field launch.sh or megatron_args.txt writes are either refused by the validator,
naming the field, or arrive as one literal argument of srun, sbatch's #SBATCH lines or torchrun
(fake commands on PATH record what they get) while nothing else runs."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_data_config import fake_prefix

from toolkit.emit.files import write_run_files
from toolkit.plan.layout import resolve
from toolkit.plan.validate import validate

HOSTILE = [
    "plain-value_1.0",  # arrives everywhere: the check below sees it
    "a $(touch pwned-dollar) b",
    "`touch pwned-backtick`",
    "x;touch pwned-semicolon",
    "line\ntouch pwned-newline",
    'it\'s "quoted"',
    "*",
    "$HOME",
    "--flag=$(touch pwned-nospace)",
]
# field -> how it reaches the job: an srun flag's prefix, an exported variable, an #SBATCH option's
# prefix, or a comment of the script
SRUN = {"cluster.slurm.container_image": "--container-image=", "cluster.slurm.container_mounts": "--container-mounts="}
ENV = {"cluster.slurm.socket_ifname": "NCCL_SOCKET_IFNAME"}
SBATCH = {
    "cluster.slurm.partition": "--partition=",
    "cluster.slurm.account": "--account=",
    "cluster.slurm.qos": "--qos=",
    "cluster.slurm.time": "--time=",
    "cluster.slurm.constraint": "--constraint=",
    "cluster.slurm.extra_sbatch": "",
    "cluster.slurm.log_dir": "--output=",
    "model.name": "--job-name=parakit-",
}
COMMENT = ("cluster.name", "cluster.gpu")
PLAIN = {"cluster.slurm.time": "1-04:00:00"}  # a field with a format of its own: a plain value of it
FAKES = {  # each records its arguments, NUL-separated, and the socket variable it was started with
    "srun": 'printf "%s\\0" "$@" > "$RECORD/srun"; printf "%s" "${NCCL_SOCKET_IFNAME-}" > "$RECORD/env"',
    "torchrun": 'printf "%s\\0" "$@" > "$RECORD/torchrun"',
    "scontrol": "echo node1",
}


def with_value(cfg, path: str, value):
    """cfg with the field at the dotted `path` set to `value` (a list field gets [value])."""
    head, _, rest = path.partition(".")
    section = getattr(cfg, head)
    if not rest:
        return dataclasses.replace(cfg, **{head: [value] if isinstance(section, list) else value})
    return dataclasses.replace(cfg, **{head: with_value(section, rest, value)})


def run_script(run: Path, tmp_path: Path, fakes_: dict | None = None, **env) -> dict:
    """launch.sh under Slurm's variables with the fake commands (`fakes_`: other bodies for some);
    what each recorded, and the script's stderr."""
    fakes, record = tmp_path / "bin", tmp_path / "record"
    for directory in (fakes, record):
        directory.mkdir(exist_ok=True)
    for name, body in (FAKES | (fakes_ or {})).items():
        (fakes / name).write_text(f"#!/bin/bash\n{body}\n")
        (fakes / name).chmod(0o755)
    assert subprocess.run(["bash", "-n", str(run / "launch.sh")]).returncode == 0
    done = subprocess.run(
        ["bash", str(run / "launch.sh")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": f"{fakes}:/usr/bin:/bin", "RECORD": str(record), "HOME": str(tmp_path), **env},
    )
    assert done.returncode == 0, done.stderr
    assert not list(tmp_path.rglob("pwned*")), "a value ran as a command"
    return {p.name: p.read_text() for p in record.iterdir()} | {"stderr": done.stderr}


def sbatch_options(text: str) -> list[str]:
    """The #SBATCH lines' words, split at whitespace as sbatch does (the values hold no quotes or
    backslashes, which it would read as its own: the schema refuses them)."""
    return [word for line in text.splitlines() if line.startswith("#SBATCH ") for word in line.split()[1:]]


@pytest.mark.parametrize("path", [*SRUN, *ENV, *SBATCH, *COMMENT])
def test_a_hostile_value_is_refused_or_arrives_literally(compose, tmp_path, path):
    base = compose("model=tiny", "cluster=h100_cluster", "cluster.nodes=2", "train.global_batch=64", "data=synthetic")
    arrived = refused = 0
    for i, value in enumerate([PLAIN.get(path, HOSTILE[0]), *HOSTILE[1:]]):
        cfg = with_value(base, path, value)
        errors = validate(cfg).errors
        if errors:
            assert any(path in e.fields for e in errors), (value, [e.rule for e in errors])
            refused += 1
            continue
        run = tmp_path / f"run{i}"
        write_run_files(cfg, resolve(cfg), run)
        recorded = run_script(run, tmp_path, SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node1", SLURM_SUBMIT_DIR=str(run))
        srun = recorded["srun"].split("\0")
        if path in SRUN:
            assert SRUN[path] + value in srun
        elif path in ENV:
            assert recorded["env"] == value
        elif path in SBATCH:
            assert SBATCH[path] + value + ("/%x-%j.out" if path.endswith("log_dir") else "") in sbatch_options(
                (run / "launch.sh").read_text()
            )
            if path.endswith("log_dir"):
                assert f"--output={value}/%x-%j-node%n.log" in srun
        arrived += 1
    # a plain value arrives everywhere; a field that cannot carry every character refuses some
    assert arrived and (refused or path in SRUN or path in ENV), (arrived, refused)


def test_megatron_lm_gets_a_hostile_data_path_word_for_word(compose, tmp_path):
    """PARAKIT_ENTRY=megatron-lm: pretrain_gpt.py's arguments from megatron_args.txt, shell-quoted
    there and read back by shlex, where $(cat ...) split and globbed them."""
    rest = "`touch${IFS}pwned-bt`$(touch${IFS}pwned-dollar);'q\""
    folder = tmp_path / f"d*{rest}"
    folder.mkdir()
    prefix = fake_prefix(folder, "corpus", vocab=50_000)
    (tmp_path / f"dX{rest}").mkdir()  # the glob d*... matches it: $(cat ...) would pass dX.../corpus on
    (tmp_path / f"dX{rest}" / "corpus").touch()
    cfg = with_value(compose("model=tiny", "cluster=8xh100", "train.global_batch=64"), "data.path", prefix)
    assert validate(cfg).ok, validate(cfg).errors
    run = tmp_path / "run"
    write_run_files(cfg, resolve(cfg), run)
    recorded = run_script(
        run, tmp_path, PARAKIT_ENTRY="megatron-lm", MEGATRON_LM_DIR="/mlm", PARAKIT_PYTHON=sys.executable
    )
    argv = recorded["torchrun"].split("\0")
    assert argv[argv.index("--data-path") + 1] == prefix
    assert argv[argv.index("--tokenizer-model") + 1] == f"{prefix}.tokenizer"
    assert "/mlm/pretrain_gpt.py" in argv


def test_megatron_lm_entry_refuses_a_cpu_cluster(compose, tmp_path):
    cfg = compose("recipe=tiny_cpu_demo")
    run = tmp_path / "run"
    write_run_files(cfg, resolve(cfg), run)
    done = subprocess.run(
        ["bash", str(run / "launch.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "PARAKIT_ENTRY": "megatron-lm"},
    )
    assert done.returncode == 2 and "trains on CUDA GPUs only" in done.stderr, done.stderr


@pytest.mark.parametrize("option", ["probe", "calibrate"])
def test_an_output_name_cannot_leave_its_folder(tmp_path, option):
    """`--name` becomes CONFIG_DIR/cluster/NAME.yaml: a path is refused before anything runs."""
    from toolkit.cli import main

    args = ["probe", "--output", str(tmp_path)] if option == "probe" else ["calibrate", str(tmp_path)]
    assert main([*args, "--name", "../../escaped"]) == 2
    assert not any(tmp_path.parent.rglob("escaped*"))
    # a shipped cluster's name: the file would be refused by the command it suggests (cluster=cpu ...)
    assert main([*args, "--name", "cpu"]) == 2
    assert not (tmp_path / "cluster" / "cpu.yaml").exists()


def test_a_hugging_face_directory_name_becomes_a_name(tmp_path):
    """model=hf takes model.name from the directory's name, made a name: it names the job and folders."""
    import shutil

    from toolkit.config.store import compose_config

    source = Path(__file__).parent / "data" / "hf_qwen2"
    folder = tmp_path / "Qwen2 (copy) $(touch pwned)"
    shutil.copytree(source, folder)
    cfg = compose_config(["model=hf", f"model.hf_path='{folder}'", "data=synthetic"])
    assert cfg.model.name == "Qwen2__copy____touch_pwned_"
    assert not any(e.rule == "name" for e in validate(cfg).errors)


def test_megatron_lm_saves_and_logs_into_the_run_directory(compose, tmp_path):
    """PARAKIT_ENTRY=megatron-lm: --load and --save in a folder of their own under checkpoint.dir (a
    hostile one arriving whole), TensorBoard and W&B in the run directory under its name, W&B
    offline as parakit's is, and a word on stderr that MLflow is parakit's alone."""
    checkpoints = str(tmp_path / "ck $(touch pwned-ck) `x`;'q\"")
    cfg = compose(
        "model=tiny",
        "cluster=8xh100",
        "train.global_batch=64",
        "data=synthetic",
        "checkpoint.interval_steps=5",
        "train.loggers=[jsonl,tensorboard,wandb,mlflow]",
    )
    cfg = with_value(cfg, "checkpoint.dir", checkpoints)
    assert validate(cfg).ok, validate(cfg).errors
    run = tmp_path / "run"
    write_run_files(cfg, resolve(cfg), run)
    torchrun = 'printf "%s" "${WANDB_MODE-}" > "$RECORD/wandb_mode"; ' + FAKES["torchrun"]
    recorded = run_script(
        run,
        tmp_path,
        {"torchrun": torchrun},
        PARAKIT_ENTRY="megatron-lm",
        MEGATRON_LM_DIR="/mlm",
        PARAKIT_PYTHON=sys.executable,
    )
    argv = recorded["torchrun"].split("\0")

    def value(flag):
        return argv[argv.index(flag) + 1]

    assert value("--load") == value("--save") == f"{checkpoints}/megatron-lm"
    assert value("--save-interval") == "5"
    assert value("--tensorboard-dir") == f"{run}/tensorboard"
    assert (value("--wandb-save-dir"), value("--wandb-exp-name"), value("--wandb-project")) == (
        str(run),
        "run",
        "parakit",
    )
    assert recorded["wandb_mode"] == "offline"
    assert "no MLflow logger" in recorded["stderr"]
