import os
import subprocess
import time
import warnings

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed: no GPU probing in tests
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*absl.logging is not installed.*")

from toolkit.config.store import compose_config  # noqa: E402


@pytest.fixture
def compose():
    """compose(*overrides) -> Config, through Hydra exactly as the CLI composes it."""
    return lambda *overrides: compose_config(list(overrides))


@pytest.fixture
def no_processes_left_behind(tmp_path):
    """No process of this test's runs (their command lines name its directory) outlives the test."""
    yield
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, f"training processes left behind: {left}"
