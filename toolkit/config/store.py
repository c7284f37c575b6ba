"""Registers the typed schema in Hydra's ConfigStore and composes configurations.

`conf/config.yaml` names `parakit_schema` first in its defaults list, so every group file is
merged into the dataclasses of `toolkit.config.schema`: a wrong type or an unknown key fails at
composition, before the validator runs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from toolkit.config.schema import Config

SCHEMA_NAME = "parakit_schema"


def register_schema() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)


def conf_dir() -> Path:
    """The conf/ folder: $PARAKIT_CONF_DIR, else the checkout this package lives in."""
    if "PARAKIT_CONF_DIR" in os.environ:
        return Path(os.environ["PARAKIT_CONF_DIR"]).resolve()
    return Path(__file__).resolve().parents[2] / "conf"


def quote_numeric_choices(overrides: list[str]) -> list[str]:
    """`zero=3` -> `zero='3'`: Hydra's override grammar reads 3 as an integer, but a config
    group option is a file name. Also covers sweeps (`zero=0,1,2,3`) and `+`/`~` prefixes."""
    groups = {p.name for p in conf_dir().iterdir() if p.is_dir()}
    out = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+~") in groups and re.fullmatch(r"\d+(,\d+)*", value):
            value = ",".join(f"'{v}'" for v in value.split(","))
        out.append(f"{key}{sep}{value}")
    return out


def to_config(cfg) -> Config:
    """A composed OmegaConf node -> plain `Config` dataclasses (what toolkit.plan reads)."""
    return OmegaConf.to_object(cfg)


def compose_config(overrides: list[str] | None = None) -> Config:
    """Compose conf/ with Hydra overrides, outside a Hydra app (tests, notebooks)."""
    register_schema()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=quote_numeric_choices(list(overrides or []))))
