"""`pip install` of a built wheel (not editable) into a fresh venv, used from another directory:
the configs ship inside the package and a team's own directory composes with them."""

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from user_configs import write_user_configs

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, cwd, env=None):
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    # Build from a copy of what the wheel is made of, so the checkout gets no build/ or egg-info.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "toolkit", src / "toolkit", ignore=shutil.ignore_patterns("__pycache__"))
    _run(sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path, cwd=src)
    (wheel,) = tmp_path.glob("parakit-*.whl")

    # A fresh venv whose dependencies come from this one's site-packages through a .pth line: the
    # checkout's editable install (itself a .pth there) is not processed from a path added that way.
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run(python, "-c", purelib, cwd=tmp_path).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = (sys.executable, "-m", "pip", "--python", python)
    _run(*pip, "install", "--no-deps", "--no-index", "-q", wheel, cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PARAKIT_CONFIG_PATH")}
    env["DS_ACCELERATOR"] = "cpu"
    where = "import toolkit.config.store as s; print(s.__file__); print(s.conf_dir())"
    where = _run(python, "-c", where, cwd=elsewhere, env=env)
    module, conf = where.stdout.split()
    assert Path(module).is_relative_to(venv) and Path(conf).is_relative_to(venv)
    assert (Path(conf) / "recipe" / "llama3_8b_8xh100.yaml").is_file()

    parakit = venv / "bin" / "parakit"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert _run(parakit, "--version", cwd=elsewhere, env=env).stdout.strip() == f"parakit {version}"
    assert "valid" in _run(parakit, "validate", "recipe=tiny_cpu_demo", cwd=elsewhere, env=env).stdout
    assert "decision path" in _run(parakit, "plan", "--top", "3", cwd=elsewhere, env=env).stdout
    _run(parakit, "generate", "recipe=llama3_8b_8xh100", "hydra.run.dir=run", cwd=elsewhere, env=env)
    assert (elsewhere / "run" / "deepspeed.json").is_file() and (elsewhere / "run" / "launch.sh").is_file()
    team = write_user_configs(tmp_path / "team")
    out = _run(parakit, "validate", "--config-dir", team, "recipe=my_recipe", cwd=elsewhere, env=env).stdout
    assert out.startswith("my_model on cpu")
