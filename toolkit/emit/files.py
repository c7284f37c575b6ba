"""Writes the five generated files of a run directory, each one atomically."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml

from toolkit.config.schema import Config, plain
from toolkit.emit.deepspeed import deepspeed_config
from toolkit.emit.launch import launch_script
from toolkit.emit.megatron import megatron_sections
from toolkit.emit.megatron_args import megatron_args
from toolkit.formats.atomic import write_atomic
from toolkit.plan.layout import Layout

GENERATED = ("config.yaml", "deepspeed.json", "megatron.yaml", "megatron_args.txt", "launch.sh")


def resolved_config(cfg: Config, layout: Layout) -> Config:
    """The configuration with its derived values (dp, grad_accum, steps) filled in."""
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, dp=layout.dp),
        train=dataclasses.replace(cfg.train, grad_accum=layout.grad_accum, steps=layout.steps),
    )


def render(cfg: Config, layout: Layout) -> dict[str, str]:
    """File name -> contents, for every generated file."""
    sections = megatron_sections(cfg, layout)
    return {
        # plain(): enum members as their strings (yaml.safe_dump refuses str subclasses)
        "config.yaml": yaml.safe_dump(plain(resolved_config(cfg, layout)), sort_keys=False),
        "deepspeed.json": json.dumps(deepspeed_config(cfg, layout), indent=2) + "\n",
        "megatron.yaml": yaml.safe_dump(plain(sections), sort_keys=False),
        "megatron_args.txt": "\n".join(megatron_args(cfg, layout, sections)) + "\n",
        "launch.sh": launch_script(cfg, layout),
    }


def write_run_files(cfg: Config, layout: Layout, out_dir: Path) -> list[Path]:
    """Render everything first (so a rendering error writes nothing), then write each file."""
    files = render(cfg, layout)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in files.items():
        path = out_dir / name
        write_atomic(path, text, executable=name.endswith(".sh"))
        paths.append(path)
    return paths
