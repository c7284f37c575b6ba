import os
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
