"""What parakit writes stays its user's: a password inside a URI is refused before anything is
written (and shown masked), and files are created as the user's umask allows, never wider."""

import os
import stat
import subprocess
import sys

from toolkit.formats.atomic import write_atomic
from toolkit.plan.validate import validate


def parakit(*args, cwd, umask=0o022):
    return subprocess.run(
        [sys.executable, "-m", "toolkit.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.umask(umask),
    )


def _modes(folder):
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


def test_generated_files_follow_the_umask(tmp_path):
    """Under umask 077 every file generate writes is its owner's alone (launch.sh stays executable);
    under 022 they are readable by all, as open(2) makes them."""
    for umask, plain, script in ((0o077, 0o600, 0o700), (0o022, 0o644, 0o755)):
        out = tmp_path / f"out{umask:o}"
        result = parakit("generate", "model=tiny", f"hydra.run.dir={out}", cwd=tmp_path, umask=umask)
        assert result.returncode == 0, result.stderr
        modes = _modes(out)
        assert modes.pop("launch.sh") == script
        assert {"config.yaml", "deepspeed.json", "megatron.yaml", "megatron_args.txt"} <= set(modes)
        assert set(modes.values()) == {plain}, modes  # Hydra's .hydra/ files too


def test_write_atomic_creates_what_the_umask_allows(tmp_path):
    before = os.umask(0o027)
    try:
        write_atomic(tmp_path / "a.json", "{}")
        write_atomic(tmp_path / "run.sh", "true\n", executable=True)
    finally:
        os.umask(before)
    assert _modes(tmp_path) == {"a.json": 0o640, "run.sh": 0o750}


def test_a_password_on_the_command_line_is_refused_before_anything_is_written(tmp_path):
    uri = "https://bob:s3cret@mlflow.example.com"
    for command in ("train", "validate", "plan"):
        result = parakit(command, "model=tiny", f"train.mlflow_tracking_uri={uri}", "hydra.run.dir=run", cwd=tmp_path)
        assert result.returncode == 1, result.stderr
        assert "s3cret" not in result.stdout + result.stderr and "https://bob:***@mlflow.example.com" in result.stderr
        assert "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" in result.stderr
        assert "Traceback" not in result.stderr and list(tmp_path.iterdir()) == []


def test_a_password_from_a_config_file_is_the_validators_error(compose):
    """A value composed from a YAML file (the command line's check never sees it) is refused by
    the validator, for any text field, shown masked."""
    report = validate(compose("train.mlflow_tracking_uri=https://bob:s3cret@host:5000", "data.tokenizer=gpt2"))
    (error,) = [e for e in report.errors if e.rule == "password"]
    assert "train.mlflow_tracking_uri='https://bob:***@host:5000'" in str(error) and "s3cret" not in str(report)
    report = validate(compose("cluster.slurm.container_image=https://ci:tok3n@registry.example.com/image"))
    assert [e.fields for e in report.errors if e.rule == "password"] == [
        {"cluster.slurm.container_image": "https://ci:***@registry.example.com/image"}
    ]
    assert not [
        e for e in validate(compose("train.mlflow_tracking_uri=http://host:5000")).errors if e.rule == "password"
    ]
