"""Resume a megatron checkpoint into another model-parallel layout.

The megatron backend saves the distributed optimizer dp_reshardable (toolkit.train.megatron_backend):
every rank writes its own shards, which another tp/pp/vpp/cp/ep cannot read. Before the ranks of
such a run start, `parakit train` converts the newest checkpoint once, as Megatron-LM's users do
by hand: the ranks of the layout it was saved with load it and save it again fully_reshardable
(Megatron-LM's --dist-ckpt-optim-fully-reshardable), which any layout loads. The converted
checkpoint is published as the same step (publishing keeps the original beside it as
.step_N.replaced); the conversion costs one load and one save at the saved layout, with the
optimizer state gathered over each data-parallel group, on this one node.

    python -m toolkit.train --config-dir RUN_DIR/reshard --convert-checkpoint   # each rank of the conversion
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

from toolkit.config.schema import Config
from toolkit.plan.layout import Layout, resolve
from toolkit.train import checkpoint as ckpt

FOLDER = "reshard"  # in the run directory: the conversion's configuration


def _needs_conversion(cfg: Config, layout: Layout, root: Path) -> tuple[Path, dict, str] | None:
    """(the newest checkpoint, its trainer state, what changed) when it is dp_reshardable and this
    layout's model-parallel degrees differ; the ranks verify it in full when they load it."""
    from toolkit.train.megatron_backend import PARALLEL, RESHARDABLE, layout_change, model_parallel_layout

    directory = ckpt.find_resumable(root, report=lambda _: None, check=lambda c: ckpt.verify(c, "size"))
    if directory is None:
        return None
    state = ckpt.trainer_state(directory)
    if state.get("optimizer_format", RESHARDABLE) != PARALLEL:
        return None
    moved = layout_change(state, model_parallel_layout(layout, cfg))
    return (directory, state, moved) if moved else None


def _conversion_config(cfg: Config, state: dict, root: Path) -> Config:
    """The run as it was saved: its model-parallel degrees and dp on one node, no training, the
    checkpoint saved fully reshardable."""
    saved = state["layout"]
    degrees = {k: saved.get(k, 1) for k in ("tp", "pp", "vpp", "cp", "ep")}
    global_batch = state["consumed_samples"] // max(state["step"], 1)
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, **degrees, dp=saved["dp"]),
        cluster=dataclasses.replace(cfg.cluster, nodes=1, gpus_per_node=saved["world"]),
        checkpoint=dataclasses.replace(cfg.checkpoint, dir=str(root), resume=True, reshardable=True, async_save=False),
        train=dataclasses.replace(
            cfg.train, global_batch=global_batch, grad_accum=None, init_checkpoint=None, save_init_checkpoint=None
        ),
    )


def convert_for_layout(cfg: Config, layout: Layout, run_dir: Path) -> None:
    """(`parakit train`, before the ranks start) Convert the newest checkpoint under the run's
    checkpoint.dir when this layout cannot load it; nothing when it can."""
    from toolkit.emit.files import write_run_files
    from toolkit.train.loop import checkpoint_root
    from toolkit.train.stop import run_group
    from toolkit.train.torchrun import torchrun_command, torchrun_env

    root = checkpoint_root(cfg, run_dir)
    found = _needs_conversion(cfg, layout, root) if cfg.checkpoint.resume else None
    if found is None:
        return
    directory, state, moved = found
    world = state["layout"]["world"]
    if cfg.cluster.nodes > 1 or (cfg.cluster.device != "cpu" and world > _local_gpus()):
        raise ckpt.ResumeError(
            f"checkpoint {directory} was saved at another model-parallel layout ({moved}) in the dp_reshardable "
            f"format, and converting it needs its {world} ranks on one node. Fix: run the conversion on a node with "
            f"{world} GPUs (`parakit train` there with this configuration converts it and starts), or resume at the "
            "saved layout once with checkpoint.reshardable=true and let it save"
        )
    print(
        f"parakit train: {directory.name} was saved at another layout ({moved}); converting it once to a "
        f"checkpoint any layout loads ({world} rank(s) at the saved layout load and save it again)",
        flush=True,
    )
    conversion = _conversion_config(cfg, state, root)
    folder = run_dir / FOLDER
    write_run_files(conversion, resolve(conversion), folder)
    command = torchrun_command(folder, world, worker_args=("--convert-checkpoint",))
    code = run_group(command, env=torchrun_env(conversion))
    if code != 0:
        raise ckpt.ResumeError(f"converting {directory} for this layout failed (exit {code}): see the lines above")


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def convert(cfg: Config) -> None:
    """(every rank of the conversion) Load the newest checkpoint at its own layout and publish it
    again fully reshardable, with the trainer state it had."""
    from toolkit.train.megatron_backend import RESHARDABLE, model_parallel_layout, save_checkpoint, setup

    layout = resolve(cfg)
    steps = setup(cfg, layout)
    root = Path(cfg.checkpoint.dir)
    resume = steps.load(root)
    state = ckpt.trainer_state(Path(resume.checkpoint))
    save_checkpoint(
        root,
        resume.step,
        steps.chunks,
        steps.optimizer,
        SimpleNamespace(state_dict=lambda: state["scheduler"]),  # as saved, not as this run would schedule
        layout,
        keep_last=0,
        fault=SimpleNamespace(crash_in_save_at_step=None, corrupt_checkpoint_at_step=None),
        verify=cfg.checkpoint.verify,
        optimizer_format=RESHARDABLE,
        model_parallel=model_parallel_layout(layout, cfg),
        saved_by=state.get("model"),  # as saved
    )
    steps.close()
