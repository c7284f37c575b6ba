"""Registers the typed schema in Hydra's ConfigStore, finds the config search path and composes.

`conf/config.yaml` (shipped inside the package, `toolkit/conf`) names `parakit_schema` first in
its defaults list, so every group file is merged into the dataclasses of `toolkit.config.schema`:
a wrong type or an unknown key fails at composition, before the validator runs.

The search path is the package's conf/ followed by the user's directories (`--config-dir DIR`,
then the `PARAKIT_CONFIG_PATH` entries): each holds group folders (`model/`, `cluster/`,
`recipe/`, ...). A user option adds a name; it cannot replace a shipped one, so every name means
one file and a clash is an error rather than a silent choice of one of them.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType, ValueType
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError

from toolkit.config import machine
from toolkit.config.schema import NAME, Config, StackCosts
from toolkit.families import hf_config
from toolkit.formats import hf_arch

SCHEMA_NAME = "parakit_schema"
CONFIG_PATH_ENV = "PARAKIT_CONFIG_PATH"
_NAME_PART = re.compile(NAME)  # each part of an option name (`model/NAME` in a user directory)


class SearchPathError(ValueError):
    """A user config directory that does not exist, or whose options clash with another's."""


class UnknownOptionError(MissingConfigException):
    """A config group option that no directory of the search path holds (or a path, refused), or
    a key that no field of the schema has."""


def register_schema() -> None:
    """Put the typed schema in Hydra's ConfigStore under the name config.yaml's defaults use, and
    register the `${hf:FIELD,DIR}` resolver (a field of DIR/config.json: conf/model/hf.yaml) and
    `${probed:FIELD,GUESS}` (this machine's measured constants: conf/cluster/cpu.yaml)."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)
    if not OmegaConf.has_resolver("hf"):
        OmegaConf.register_new_resolver("hf", hf_config.field)
    if not OmegaConf.has_resolver("probed"):
        OmegaConf.register_new_resolver("probed", machine.probed)


def conf_dir() -> Path:
    """The conf/ folder shipped inside the installed package."""
    return Path(str(files("toolkit") / "conf"))


def search_path(config_dirs: Sequence[str | Path] = ()) -> list[Path]:
    """The package's conf/, then `config_dirs`, then the `PARAKIT_CONFIG_PATH` entries (os.pathsep
    separated). Raises SearchPathError for a directory that is missing or that holds a file
    (`model/tiny.yaml`, `config.yaml`) another directory of the path already has."""
    given = [(str(d), "--config-dir") for d in config_dirs]
    given += [(d, CONFIG_PATH_ENV) for d in os.environ.get(CONFIG_PATH_ENV, "").split(os.pathsep) if d]
    dirs = [conf_dir()]
    for raw, source in given:
        path = Path(raw).expanduser().resolve()
        if not path.is_dir():
            raise SearchPathError(f"{source} {raw}: not a directory")
        if path not in dirs:
            dirs.append(path)
    owner: dict[Path, Path] = {}
    for d in dirs:
        for file in d.rglob("*.yaml"):
            rel = file.relative_to(d)
            if rel in owner:
                raise SearchPathError(
                    f"{file}: {owner[rel] / rel} has this name already; rename the user option "
                    "(options add names to the search path, they cannot replace one)"
                )
            owner[rel] = d
            if d != dirs[0]:
                _check_yaml(file)
    return dirs


def _check_yaml(file: Path) -> None:
    """A user's config file reads as YAML and holds a mapping (Hydra would end in a traceback)."""
    import yaml

    try:
        content = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SearchPathError(f"{file}: not valid YAML{where}: {problem}; fix the file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SearchPathError(f"{file}: cannot be read ({e})") from None
    if content is not None and not isinstance(content, dict):
        raise SearchPathError(f"{file}: holds a {type(content).__name__}, not a mapping of fields; fix the file")


def group_options(dirs: Sequence[Path]) -> dict[str, list[str]]:
    """Config group -> its option names, over every directory of the search path."""
    options: dict[str, set[str]] = {}
    for d in dirs:
        for group in d.iterdir():
            if group.is_dir() and group.name != "baselines":  # recipes' expected results, no config group
                options.setdefault(group.name, set()).update(p.stem for p in group.glob("*.yaml"))
    return {group: sorted(names) for group, names in sorted(options.items()) if names}


def _values(override) -> list:
    """The option names one parsed override asks for (every choice of a sweep)."""
    if override.is_delete() or override.value_type in (ValueType.GLOB_CHOICE_SWEEP, ValueType.INTERVAL_SWEEP):
        return []
    if override.is_sweep_override():  # a quoted choice ('3') stays a QuotedString here
        return [getattr(v, "text", v) for v in override.sweep_iterator()]
    return [override.value()]


def check_overrides(overrides: Sequence[str], dirs: Sequence[Path]) -> None:
    """Raise UnknownOptionError for a group option (`recipe=NAME`) that no directory of the search
    path holds, naming the available options and the closest one; a path (`..`, absolute) is
    refused before anything is read; likewise a key no field has (`_check_field`). Hydra itself
    reports overrides that do not parse."""
    groups = group_options(dirs)
    parser = OverridesParser.create()
    for text in overrides:
        if text.startswith("-") or "=" not in text:
            continue  # a Hydra flag (`--cfg job`, `-m`), not an override
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException:
            continue
        group = override.key_or_group
        if group == "hydra.searchpath":
            raise SearchPathError(f"{text}: add config directories with --config-dir DIR or ${CONFIG_PATH_ENV}")
        if group not in groups:
            # `+key` too: the schema's dataclasses take no new keys, and OmegaConf drops one silently
            plain = override.type != OverrideType.DEL and override.package is None  # not ~key, not @package
            if plain and re.fullmatch(r"[\w.]+", group) and not group.startswith("hydra."):
                _check_field(group)
            continue
        for value in _values(override):
            if value is None:
                continue  # `recipe=null`: no option
            value = str(value)
            parts = value.split("/")
            is_name = all(_NAME_PART.fullmatch(p) for p in parts)
            if is_name and any((d / group / f"{value}.yaml").is_file() for d in dirs):
                continue
            available = ", ".join(groups[group])
            if not is_name:
                raise UnknownOptionError(
                    f"{group}={value}: an option is a name from the config search path, not a path "
                    f"('..', '/' at the start and other characters are refused). Available: {available}"
                )
            close = difflib.get_close_matches(value, groups[group], n=1)
            hint = f" Did you mean {group}={close[0]}?" if close else ""
            where = ", ".join(str(d) for d in dirs)
            raise UnknownOptionError(
                f"{group}={value}: no {group} of that name.{hint} Available: {available} (search path: {where})"
            )


def _check_field(key: str) -> None:
    """Raise UnknownOptionError for a dotted key that no field of the schema has, naming the
    closest field (Hydra says only that the key is not in the dataclass)."""
    node, walked = Config(), []  # the defaults: every section is a dataclass instance
    for part in key.split("."):
        where = ".".join(walked) or "the config"
        if isinstance(node, list) and not part.isdigit():  # OmegaConf would fail with a bare int() error
            raise UnknownOptionError(f"{key}: {where} is a list: set it whole ({where}=[...]) or an item ({where}.0)")
        if not dataclasses.is_dataclass(node):
            return  # below a plain field: Hydra reports what is wrong
        fields = [f.name for f in dataclasses.fields(node)]
        if part not in fields:
            close = difflib.get_close_matches(part, fields, n=1)
            hint = f" Did you mean {'.'.join([*walked, close[0]])}?" if close else ""
            raise UnknownOptionError(f"{key}: {where} has no field {part!r}.{hint} Fields: {', '.join(fields)}")
        node = getattr(node, part)
        walked.append(part)


def quote_numeric_choices(overrides: list[str], dirs: Sequence[Path] | None = None) -> list[str]:
    """`zero=3` -> `zero='3'`: Hydra's override grammar reads 3 as an integer, but a config
    group option is a file name. Also covers sweeps (`zero=0,1,2,3`) and `+`/`~` prefixes."""
    groups = set(group_options(dirs or [conf_dir()]))
    out = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+~") in groups and re.fullmatch(r"\d+(,\d+)*", value):
            value = ",".join(f"'{v}'" for v in value.split(","))
        out.append(f"{key}{sep}{value}")
    return out


def hydra_overrides(overrides: Sequence[str], dirs: Sequence[Path]) -> list[str]:
    """The user's overrides, checked and quoted, plus `hydra.searchpath` for the user directories
    (Hydra searches them after the package's conf/, which stays the primary config's home)."""
    quoted = quote_numeric_choices(list(overrides), dirs)
    check_overrides(quoted, dirs)
    users = [str(d).replace("'", "\\'") for d in dirs[1:]]
    if users:
        quoted.append("hydra.searchpath=[" + ",".join(f"'file://{d}'" for d in users) + "]")
    return quoted


def to_config(cfg) -> Config:
    """A composed OmegaConf node -> plain `Config` dataclasses (what toolkit.plan reads). A bad
    model.hf_path under model=hf raises HfConfigError with OmegaConf's wrapping taken off."""
    try:
        config = OmegaConf.to_object(cfg)
    except InterpolationResolutionError as e:
        cause = e
        while cause is not None and not isinstance(cause, hf_arch.HfConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise hf_arch.HfConfigError(str(cause)) from None
    # a resolver's value is not typed by the schema: `${probed:stack}` gives plain dicts
    config.cluster.stack = {
        name: StackCosts(**dict(costs)) if not isinstance(costs, StackCosts) else costs
        for name, costs in config.cluster.stack.items()
    }
    return config


def load_run_config(run_dir: Path, name: str = "config") -> Config:
    """The config.yaml that `parakit generate`/`train` wrote into a run directory, typed again
    (torch-free: `parakit report` reads it without importing the trainer)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(run_dir / f"{name}.yaml")))


def compose_config(overrides: list[str] | None = None, config_dirs: Sequence[str | Path] = ()) -> Config:
    """Compose the search path (the package's conf/, `config_dirs`, $PARAKIT_CONFIG_PATH) with Hydra
    overrides, outside a Hydra app (tests, notebooks). Raises UnknownOptionError for an unknown
    group option and SearchPathError for a bad config directory."""
    register_schema()
    dirs = search_path(config_dirs)
    final = hydra_overrides(list(overrides or []), dirs)
    with initialize_config_dir(config_dir=str(dirs[0]), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=final))


def datasheet_cluster(device_name: str) -> str | None:
    """The conf/cluster file of this GPU model: the first cuda file whose `gpu` starts with the
    model in torch's device name ("NVIDIA H200" -> H200 -> 1xh200's H200-SXM; "NVIDIA A100-SXM4-80GB"
    -> A100), one-node files first; None where none does."""
    models = re.findall(r"\b([A-Z]\d{2,3})", device_name.upper())
    found = []
    for path in sorted((conf_dir() / "cluster").glob("*.yaml")):
        cluster = OmegaConf.load(path)
        if cluster.get("device") != "cuda" or not models:
            continue
        if str(cluster.get("gpu", "")).upper().startswith(models[0]):
            found.append((cluster.get("nodes", 1) != 1, path.stem))
    return min(found)[1] if found else None
