"""The config search path: user directories next to the shipped conf/, and group options that must exist."""

import os

import pytest
from hydra._internal.core_plugins.file_config_source import FileConfigSource
from user_configs import write_user_configs

from toolkit.config.store import CONFIG_PATH_ENV, SearchPathError, UnknownOptionError, compose_config, conf_dir


def test_shipped_conf_lives_in_the_package():
    assert conf_dir().parent.name == "toolkit" and (conf_dir() / "config.yaml").is_file()
    assert (conf_dir() / "recipe").is_dir() and not (conf_dir() / "recipe").is_symlink()


def test_user_config_dir_composes_via_argument_and_environment(tmp_path, monkeypatch):
    user = write_user_configs(tmp_path / "team")
    cfg = compose_config(["recipe=my_recipe"], config_dirs=[user])
    assert (cfg.model.name, cfg.model.num_layers, cfg.train.global_batch) == ("my_model", 4, 8)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv(CONFIG_PATH_ENV, f"{tmp_path / 'empty'}{os.pathsep}{user}")
    assert compose_config(["recipe=my_recipe"]).model.name == "my_model"
    assert compose_config(["model=tiny"]).model.name == "tiny"  # shipped options stay available


def test_user_option_cannot_replace_a_shipped_one_and_missing_dirs_are_named(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny.yaml").write_text("name: not_tiny\n")
    with pytest.raises(SearchPathError, match="tiny.yaml"):
        compose_config([], config_dirs=[tmp_path])
    with pytest.raises(SearchPathError, match="nowhere: not a directory"):
        compose_config([], config_dirs=[tmp_path / "nowhere"])


@pytest.mark.parametrize(
    "override,closest",
    [
        ("recipe=llama3_8b_8xhundred", "recipe=llama3_8b_8xh100"),  # the optional group: once silently ignored
        ("model=llama3_8", "model=llama3_8b"),
        ("cluster=h100_clustr", "cluster=h100_cluster"),
        ("zero=0,1,4", None),  # a sweep: every choice is checked
    ],
)
def test_unknown_group_option_names_the_available_ones_and_the_closest(compose, override, closest):
    with pytest.raises(UnknownOptionError) as error:
        compose(override)
    message = str(error.value)
    assert message.startswith(override.split("=")[0] + "=") and "Available: " in message
    assert (f"Did you mean {closest}?" in message) if closest else ("Did you mean" not in message)


@pytest.mark.parametrize("value", ["../../etc/passwd", "/etc/passwd", "{escape}"])
def test_option_that_is_a_path_is_refused_before_anything_is_read(compose, tmp_path, monkeypatch, value):
    # A file Hydra would load as a recipe if the relative path got through.
    (tmp_path / "escape.yaml").write_text("# @package _global_\nmodel:\n  name: escaped\n")
    value = value.format(escape=os.path.relpath(tmp_path / "escape", conf_dir() / "recipe"))
    read = []
    load = FileConfigSource.load_config
    monkeypatch.setattr(FileConfigSource, "load_config", lambda self, path: read.append(path) or load(self, path))
    with pytest.raises(UnknownOptionError, match="not a path"):
        compose(f"recipe={value}")
    assert read == []
