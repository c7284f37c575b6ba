"""`parakit validate|generate` as a user runs it: exit codes, messages, the five files."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from upstream import deepspeed_accepts, megatron_accepts

from toolkit.config.schema import Config
from toolkit.config.store import conf_dir
from toolkit.data.manifest import Manifest, manifest_path
from toolkit.emit.files import GENERATED

FLAGS = {
    line
    for line in (Path(__file__).parent / "data" / "megatron_lm_flags.txt").read_text().split()
    if line.startswith("--")
}


def parakit(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "toolkit.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_validate_ok_and_writes_nothing(tmp_path):
    result = parakit("validate", "recipe=tiny_cpu_demo", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "tp=2 pp=2 vpp=2" in result.stdout and "valid" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_validate_reports_every_error_with_fix_and_exits_2(tmp_path):
    result = parakit("validate", "model=llama3_8b", "parallel.tp=3", "parallel.pp=5", cwd=tmp_path)
    assert result.returncode == 2
    for rule in ("world_size", "tp_heads", "tp_ffn", "pp_layers"):
        assert f"[{rule}]" in result.stderr
    assert "Fix: use parallel.pp in {1, 2, 4, 8, 16, 32}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("override", ["parallel.tp=abc", "parallel.bogus=1", "model=nope", "zero=7"])
def test_composition_errors_name_the_field_without_traceback(tmp_path, override):
    result = parakit("validate", override, cwd=tmp_path)
    assert result.returncode == 1
    assert override.split("=")[0].split(".")[-1] in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_invalid_writes_no_files(tmp_path):
    result = parakit("generate", "parallel.tp=3", "hydra.run.dir=out", cwd=tmp_path)
    assert result.returncode == 2
    assert not any((tmp_path / "out" / name).exists() for name in GENERATED)


RECIPES = sorted(p.stem for p in (conf_dir() / "recipe").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_generate_recipe_writes_five_files_upstream_accepts(tmp_path, recipe):
    result = parakit("generate", f"recipe={recipe}", "hydra.run.dir=run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    assert all((run / name).is_file() for name in GENERATED)

    # config.yaml is the resolved configuration and still fits the schema
    resolved = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(run / "config.yaml")))
    dp, accum = resolved.parallel.dp, resolved.train.grad_accum
    assert resolved.train.global_batch == resolved.train.micro_batch * dp * accum

    ds = json.loads((run / "deepspeed.json").read_text())
    assert deepspeed_accepts(ds, dp=dp).train_batch_size == resolved.train.global_batch

    sections = yaml.safe_load((run / "megatron.yaml").read_text())
    transformer, optimizer, ddp = megatron_accepts(sections)
    assert transformer.num_layers == resolved.model.num_layers
    assert sections["training"]["num_microbatches"] == accum

    args = (run / "megatron_args.txt").read_text().split("\n")
    unknown = {a.split()[0] for a in args if a} - FLAGS
    assert not unknown, f"flags Megatron-LM does not define: {unknown}"
    assert f"--global-batch-size {resolved.train.global_batch}" in args

    launch = run / "launch.sh"
    assert subprocess.run(["bash", "-n", str(launch)]).returncode == 0
    text = launch.read_text()
    if resolved.cluster.nodes > 1:
        assert f"#SBATCH --nodes={resolved.cluster.nodes}" in text and "srun" in text and "--rdzv-backend c10d" in text
    else:
        assert f"torchrun --standalone --nnodes 1 --nproc-per-node {resolved.cluster.gpus_per_node}" in text


def test_multirun_sweeps_zero_stages(tmp_path):
    result = parakit("generate", "-m", "backend=deepspeed", "zero=0,1,2,3", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    stages = sorted(
        json.loads(p.read_text())["zero_optimization"]["stage"] for p in (tmp_path / "sweep").glob("*/deepspeed.json")
    )
    assert stages == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "override,expected",
    [
        ("recipe=llama3_8b_8xhundred", "Did you mean recipe=llama3_8b_8xh100?"),
        ("recipe=../../etc/passwd", "not a path"),
    ],
)
def test_unknown_or_path_option_is_one_clear_error(tmp_path, override, expected):
    result = parakit("validate", override, cwd=tmp_path)
    assert result.returncode == 1 and result.stdout == ""
    assert expected in result.stderr and "tiny_cpu_demo" in result.stderr  # the available names
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_user_recipe_via_config_dir_and_environment(tmp_path):
    from user_configs import write_user_configs

    user = write_user_configs(tmp_path / "team")
    result = parakit("validate", "--config-dir", str(user), "recipe=my_recipe", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("my_model on cpu")
    env = {**os.environ, "PARAKIT_CONFIG_PATH": str(user)}
    result = subprocess.run(
        [sys.executable, "-m", "toolkit.cli", "validate", "recipe=my_recipe"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.startswith("my_model on cpu"), result.stderr


def test_version_and_help(tmp_path, capsys):
    from toolkit.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"parakit {importlib.metadata.version('parakit')}"
    from user_configs import write_user_configs

    user = write_user_configs(tmp_path / "team")
    assert main(["plan", "--help", "--config-dir", str(user)]) == 0
    text = capsys.readouterr().out
    for option in ("--top N", "--json", "--config-dir DIR"):
        assert option in text
    section = text.split("\nconfig groups")[1].split("config search path")[0]
    groups = {g: set(re.split(r"[,\s]+", c)) for g, c in re.findall(r"^  (\w+) +(.+(?:\n {14}.+)*)", section, re.M)}
    assert {"my_recipe", "llama3_8b_8xh100"} <= groups["recipe"] and "my_model" in groups["model"]
    assert set(groups) >= {"model", "cluster", "recipe", "zero", "parallel", "precision", "data"}
    assert main(["validate", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--config-dir" in text and "--top" not in text


def test_options_are_parsed_per_call(tmp_path, monkeypatch, capsys):
    from toolkit.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]
    assert main(["plan"]) == 0
    second = capsys.readouterr().out
    assert not second.lstrip().startswith("{") and "decision path" in second
    assert main(["validate", "recipe=nope"]) == 1 and main(["validate"]) == 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["data=synthetic"], "data: synthetic (random tokens)"),
        (["data=corpus"], "data: corpus (the bundled King James Bible, GPT-2 BPE)"),
        (["data=corpus", "data.path=PREFIX"], "data: corpus (PREFIX: no manifest, tokenizer gpt2)"),
        (["data.path=PREFIX", "+MANIFEST"], "data: corpus (PREFIX: 3 documents, 12 tokens, tokenizer /tok, vocab 60)"),
    ],
)
def test_summary_says_which_data(tmp_path, overrides, line):
    """The summary names the data; for a prepared prefix, what its manifest says."""
    prefix = tmp_path / "my_corpus"
    for suffix in (".bin", ".idx"):
        Path(f"{prefix}{suffix}").touch()  # the validator checks that they exist
    if "+MANIFEST" in overrides:
        overrides.remove("+MANIFEST")
        Manifest("/tok", "PreTrainedTokenizerFast", 60, 0, "uint16", 3, 12).write(manifest_path(prefix))
    overrides, line = [o.replace("PREFIX", str(prefix)) for o in overrides], line.replace("PREFIX", str(prefix))
    result = parakit("validate", *overrides, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert line in result.stdout.splitlines()


def test_a_multi_node_launch_script_asks_for_gpus_only_on_gpu_clusters(compose):
    """Slurm rejects a GPU request on nodes that declare none (a CPU cluster): there the one task
    per node asks for a CPU per rank."""
    from toolkit.emit.launch import launch_script
    from toolkit.plan.layout import resolve

    cpu = compose("model=tiny", "cluster=cpu", "cluster.nodes=2", "cluster.gpus_per_node=2", "train.global_batch=8")
    text = launch_script(cpu, resolve(cpu))
    assert "#SBATCH --cpus-per-task=2" in text and "--gpus-per-node" not in text
    gpu = compose("model=tiny", "cluster=h100_cluster", "cluster.nodes=2", "train.global_batch=64")
    text = launch_script(gpu, resolve(gpu))
    assert f"#SBATCH --gpus-per-node={gpu.cluster.gpus_per_node}" in text and "--cpus-per-task" not in text


def test_cluster_slurm_settings_become_sbatch_options_and_srun_flags(compose, tmp_path):
    """cluster.slurm.*: each set field as the sbatch option of its name; a container as pyxis's
    srun flags; one log per node; without Slurm the script names what to set."""
    from toolkit.emit.launch import launch_script
    from toolkit.plan.layout import resolve

    slurm = {
        "partition": "debug", "account": "proj", "qos": "high", "time": "01:30:00", "constraint": "h100",
        "cpus_per_task": 16, "container_image": "nvcr.io/nvidia/pytorch:24.05-py3",
        "container_mounts": "/data:/data", "socket_ifname": "ib0", "log_dir": "/logs/run1",
    }  # fmt: skip
    cfg = compose(
        "model=tiny", "cluster=h100_cluster", "cluster.nodes=2", "train.global_batch=64",
        *(f"cluster.slurm.{k}={v}" for k, v in slurm.items()), "cluster.slurm.exclusive=false",
        'cluster.slurm.extra_sbatch=["--mail-type=END","--reservation=r1"]',  # Hydra: quote a leading --
    )  # fmt: skip
    text = launch_script(cfg, resolve(cfg))
    sbatch = [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH")]
    for name in ("partition", "account", "qos", "time", "constraint", "cpus_per_task"):
        assert f"--{name.replace('_', '-')}={slurm[name]}" in sbatch, (name, sbatch)
    assert {"--gpus-per-node=8", "--output=/logs/run1/%x-%j.out", "--mail-type=END", "--reservation=r1"} <= set(sbatch)
    assert "--exclusive" not in sbatch
    assert "--container-image=nvcr.io/nvidia/pytorch:24.05-py3" in text and "--container-mounts=/data:/data" in text
    assert "NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0" in text and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in text
    assert '--output="$LOG_DIR/%x-%j-node%n.log"' in text and 'LOG_DIR="${PARAKIT_LOG_DIR:-/logs/run1}"' in text
    plain = compose("model=tiny", "cluster=cpu", "cluster.nodes=2", "cluster.gpus_per_node=2", "train.global_batch=8")
    text = launch_script(plain, resolve(plain))
    assert "--partition" not in text and "#SBATCH --exclusive" in text and "--container" not in text
    (tmp_path / "launch.sh").write_text(text)
    run = subprocess.run(
        ["bash", str(tmp_path / "launch.sh")], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    assert run.returncode == 2 and "no config.yaml in" in run.stderr  # the run directory is checked first
    (tmp_path / "config.yaml").write_text("{}")
    run = subprocess.run(
        ["bash", str(tmp_path / "launch.sh")], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    assert run.returncode != 0 and "without Slurm set MASTER_ADDR to the first node" in run.stderr


def test_multi_node_train_dry_run_prints_the_batch_script_and_without_slurm_says_how(tmp_path):
    two_nodes = ["model=tiny", "data=synthetic", "cluster.nodes=2", "cluster.gpus_per_node=2", "train.global_batch=8"]
    dry = parakit("train", "--dry-run", *two_nodes, f"hydra.run.dir={tmp_path / 'dry'}", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "#SBATCH --nodes=2" in dry.stdout and "srun --ntasks-per-node=1" in dry.stdout
    assert "dry run: nothing submitted" in dry.stdout and not (tmp_path / "dry" / "logs").exists()
    logs = tmp_path / "dry" / "logs"
    assert f"would submit: cd {tmp_path / 'dry'} && sbatch --parsable --output={logs}/%x-%j.out" in dry.stdout
    one = parakit(
        "train", "--dry-run", "model=tiny", "cluster.gpus_per_node=2", f"hydra.run.dir={tmp_path}/one", cwd=tmp_path
    )
    assert one.returncode == 0 and "would run: " in one.stdout and "--nproc-per-node 2" in one.stdout, one.stderr
    assert "nothing started" in one.stdout
    no_slurm = subprocess.run(  # a PATH without sbatch
        [sys.executable, "-m", "toolkit.cli", "train", *two_nodes, f"hydra.run.dir={tmp_path / 'none'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": str(tmp_path / "bin")},
    )  # fmt: skip
    assert no_slurm.returncode == 2 and "2 nodes need Slurm, and this machine has no sbatch" in no_slurm.stderr
    hint = f"MASTER_ADDR=<first node's address> RDZV_ID=<any id, the same on every node> {tmp_path / 'none'}/launch.sh"
    assert hint in no_slurm.stderr


def test_multi_node_train_detach_submits_launch_sh_from_the_run_directory(tmp_path):
    """A stand-in sbatch records how it was called: from the run directory, with the job's log in
    its logs/ (created first: Slurm does not create it), on launch.sh; --detach returns at once."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$PWD $*" > {tmp_path}/called\necho "4242;lab"\n')
    (bin_dir / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    two_nodes = ["model=tiny", "data=synthetic", "cluster.nodes=2", "cluster.gpus_per_node=2", "train.global_batch=8"]
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "toolkit.cli", "train", "--detach", *two_nodes, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"submitted Slurm job 4242; run directory {run_dir}; logs {run_dir / 'logs'}" in done.stdout
    assert "scancel 4242" in done.stdout and (run_dir / "logs").is_dir()
    called = (tmp_path / "called").read_text().split()
    assert called == [
        str(run_dir),
        "--parsable",
        f"--output={run_dir}/logs/%x-%j.out",
        "--open-mode=append",
        f"{run_dir}/launch.sh",
    ]
