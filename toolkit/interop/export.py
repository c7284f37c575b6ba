"""`parakit export`: a training checkpoint of either backend -> a Hugging Face model directory
(safetensors shards + index, config.json, generation_config.json, tokenizer files) that
transformers' AutoModelForCausalLM loads.

    parakit export RUN_DIR --output HF_DIR [--step N] [--tokenizer DIR | --no-tokenizer]

(the options: toolkit.cli's COMMANDS)

RUN_DIR may also be the run's checkpoint directory, one step_XXXXXXXX in it (or its engine's
folder, model_optim/ or state/), or a sealed megatron-core dist checkpoint (what
train.save_init_checkpoint and `parakit convert hf-to-megatron` write) with --config. The run's
config.yaml names the model. Without --step the newest checkpoint that verifies is exported. Every
file is verified against its manifest before anything reads it: a folder without one is refused. Tensors stream
from the checkpoint (toolkit.interop.readers) into shards (toolkit.interop.hf_dir) in the dtype
the model trained in; the directory appears only when complete.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from toolkit.config.schema import Config, ModelConfig
from toolkit.train import checkpoint as ckpt


class ExportError(Exception):
    """A problem with the command's inputs; the message names the path and the fix."""


@dataclass
class Checkpoint:
    """What to export: a published checkpoint (or a bare one) and its run's config."""

    directory: Path  # step_XXXXXXXX, or the bare checkpoint
    backend: str  # "megatron" or "deepspeed", from what the directory holds
    step: int | None
    cfg: Config
    config_path: Path

    @property
    def weights(self) -> Path:
        for inner in ("model_optim", "state"):
            if (self.directory / inner).is_dir():
                return self.directory / inner
        return self.directory


def _backend_of(directory: Path) -> str | None:
    if (directory / "model_optim").is_dir() or (directory / "metadata.json").exists():
        return "megatron"
    if (directory / "state").is_dir() or any(directory.glob("*model_states.pt")):
        return "deepspeed"
    return None


def _find_config(path: Path, config: Path | None) -> Path:
    if config is not None:
        if not config.is_file():
            raise ExportError(f"--config {config} is not a file: pass the run's config.yaml")
        return config
    for directory in (path, *list(path.parents)[:3]):  # RUN_DIR/checkpoints/step_N/state at the deepest
        if (directory / "config.yaml").is_file():
            return directory / "config.yaml"
    raise ExportError(
        f"no config.yaml in {path} or the three directories above it: pass --config RUN_DIR/config.yaml "
        "(the run directory that `parakit train` wrote)"
    )


def _steps_in(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*") if p.name.split("_")[1].isdigit())


def _checked(directory: Path, root: Path) -> Path:
    problem = ckpt.verify(directory)
    if problem is not None:
        others = [s for s in _steps_in(root) if root / ckpt.step_name(s) != directory]
        hint = f"export another step with --step N (present: {others})" if others else "no other step is present"
        raise ExportError(f"checkpoint {directory} is not usable: {problem}; {hint}")
    return directory


def _step_directory(path: Path, root: Path, step: int | None) -> Path:
    """The published step directory to export from a run's checkpoint root."""
    if step is not None:
        chosen = root / ckpt.step_name(step)
        if not chosen.is_dir():
            raise ExportError(f"{root} has no checkpoint of step {step}; present: {_steps_in(root) or 'none'}")
        return _checked(chosen, root)
    if not _steps_in(root):
        raise ExportError(
            f"no checkpoints in {root} (from {path}): the run saved none; train with checkpoint.interval_steps=N "
            "(a run then also saves its last step), or point at the directory checkpoint.dir named"
        )
    problems: list[dict] = []
    found = ckpt.find_resumable(root, report=lambda message: None, unusable=problems)
    if found is None:
        detail = "; ".join(f"{p['checkpoint']}: {p['problem']}" for p in problems)
        raise ExportError(f"no usable checkpoint in {root} ({detail}); none of its saves completed intact")
    for passed in problems:
        print(f"parakit export: skipped {root / passed['checkpoint']}: {passed['problem']}", file=sys.stderr)
    return found


def locate(path: Path, step: int | None = None, config: Path | None = None) -> Checkpoint:
    """The checkpoint that `parakit export PATH [--step N] [--config FILE]` means."""
    from toolkit.config.store import load_run_config
    from toolkit.train.loop import checkpoint_root

    path = path.resolve()
    if not path.exists():
        raise ExportError(f"{path} does not exist: pass a run directory, its checkpoints/ or one step_* in it")
    config_path = _find_config(path, config)
    try:
        cfg = load_run_config(config_path.parent, config_path.stem)
    except Exception as error:  # omegaconf's errors carry the key and the file
        raise ExportError(f"{config_path} is not a parakit run config: {error}") from None
    if path.name in ("model_optim", "state") and (path.parent / ckpt.MANIFEST).exists():  # the engine's part of one
        path = path.parent
    if path.name.startswith("step_") or (path / ckpt.MANIFEST).exists():  # one published step, or a sealed folder
        directory = _checked(path, path.parent)
        if step is not None and path.name != ckpt.step_name(step) and path.name.startswith("step_"):
            raise ExportError(f"{path} is not the checkpoint of --step {step}: pass the run or its checkpoints/")
        if step is not None and not path.name.startswith("step_"):
            raise ExportError(f"{path} is one checkpoint, without steps: leave out --step {step}")
    elif _backend_of(path):  # weights without a manifest: nothing vouches for their pickles
        raise ExportError(
            f"{path} has no {ckpt.MANIFEST}: parakit reads a checkpoint's pickles only once the checksums of the "
            "manifest it was saved with verify. Fix: export the run or its published step_* folder, or write the "
            "weights again (train.save_init_checkpoint, parakit convert hf-to-megatron)"
        )
    else:
        root = path if _steps_in(path) or path.name == "checkpoints" else checkpoint_root(cfg, path)
        directory = _step_directory(path, root, step)
    backend = _backend_of(directory)
    if backend is None:
        raise ExportError(
            f"{directory} holds neither a megatron-core (model_optim/) nor a DeepSpeed (state/) checkpoint"
        )
    number = int(directory.name.split("_")[1]) if directory.name.startswith("step_") else None
    return Checkpoint(directory, backend, number, cfg, config_path)


def load_tokenizer(cfg: Config, given: Path | None):
    """The tokenizer to ship with the weights: --tokenizer, else the one the training data was
    tokenized with (a prepared prefix's PREFIX.tokenizer/, named by its manifest; data.tokenizer for
    the bundled corpus or a prefix without a manifest)."""
    from transformers import AutoTokenizer

    from toolkit.data import bundled as bundled_files
    from toolkit.formats.manifest import parse_blend, read_manifest, tokenizer_dir

    source, origin, bundled = given, "--tokenizer", False
    if given is None:
        prefix = parse_blend(cfg.data.path)[0][0] if cfg.data.path else None
        if prefix and read_manifest(prefix):  # the validator checked that every part of a blend agrees
            source, origin = tokenizer_dir(prefix), f"the manifest of data.path prefix {prefix}"
        else:
            source, origin, bundled = bundled_files.gpt2_tokenizer_dir(), f"data.tokenizer={cfg.data.tokenizer}", True
    if not Path(source).is_dir():
        raise ExportError(
            f"tokenizer directory {source} (from {origin}) does not exist: pass --tokenizer DIR or --no-tokenizer"
        )
    try:
        # The bundled files carry no tokenizer class: the corpus module knows it.
        tokenizer = bundled_files.load_tokenizer() if bundled else AutoTokenizer.from_pretrained(str(source))
    except Exception as error:
        raise ExportError(f"cannot load the tokenizer in {source} (from {origin}): {error}") from None
    if len(tokenizer) > cfg.model.vocab_size:
        raise ExportError(
            f"the tokenizer in {source} (from {origin}) has {len(tokenizer)} tokens, more than model.vocab_size="
            f"{cfg.model.vocab_size}: pass the tokenizer the model trained with, or --no-tokenizer"
        )
    tokenizer.model_max_length = cfg.model.max_position_embeddings
    return tokenizer


def _model_names(config) -> set[str]:
    """The tensor names the transformers model loads (lm_head left out when tied to the embedding)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = set(model.state_dict())
    if config.tie_word_embeddings:
        names.discard("lm_head.weight")
    return names


def tensors(checkpoint: Checkpoint):
    from toolkit.interop import readers

    m: ModelConfig = checkpoint.cfg.model
    if checkpoint.backend == "megatron":
        return readers.megatron_tensors(checkpoint.weights, m)
    return readers.deepspeed_tensors(checkpoint.weights, m)


def export(checkpoint: Checkpoint, output: Path, tokenizer=None, max_shard_bytes: int = 5 * 10**9) -> dict:
    """Write the Hugging Face directory `output` (atomically); a summary of what it holds."""
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from toolkit.families import family_of
    from toolkit.families.hf_config import hf_config
    from toolkit.formats.atomic import staged_directory
    from toolkit.interop.hf_dir import ShardWriter

    config = hf_config(checkpoint.cfg.model)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__]
    if tokenizer is not None:
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    expected = family_of(checkpoint.cfg.model.family).names_on_disk(_model_names(config), checkpoint.cfg.model)
    written: set[str] = set()
    dtypes: Counter = Counter()
    parameters = 0
    with staged_directory(output) as staging:
        writer = ShardWriter(staging, max_shard_bytes)
        for name, tensor in tensors(checkpoint):
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # transformers ties it to the embedding
            if name not in expected or name in written:
                problem = "twice" if name in written else "but the transformers model has no such tensor"
                raise ValueError(f"{checkpoint.weights} yields {name} {problem} (model {checkpoint.cfg.model.name})")
            writer.add(name, tensor)
            written.add(name)
            parameters += tensor.numel()
            if tensor.is_floating_point():
                dtypes[tensor.dtype] += tensor.numel()
        if expected - written:
            raise ValueError(f"{checkpoint.weights} lacks tensors the model needs: {sorted(expected - written)}")
        files = writer.finish()
        config.dtype = dtypes.most_common(1)[0][0]
        config.save_pretrained(staging)
        GenerationConfig.from_model_config(config).save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        summary = {
            "source": str(checkpoint.directory),
            "backend": checkpoint.backend,
            "step": checkpoint.step,
            "model": checkpoint.cfg.model.name,
            "parameters": parameters,
            "dtype": str(config.dtype).removeprefix("torch."),
            "shards": [p.name for p in files if p.suffix == ".safetensors"],
        }
        (staging / "parakit_export.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def run_export(opts) -> int:
    """`parakit export` (toolkit.cli parsed the options): 0 done, 1 a problem with the checkpoint,
    the tokenizer or the output (one line naming it and the fix), 2 a bad option."""
    from toolkit.interop.hf_dir import parse_size

    try:
        max_shard_bytes = parse_size(opts.max_shard_size)
        if opts.tokenizer and opts.no_tokenizer:
            raise ValueError("--tokenizer and --no-tokenizer exclude each other")
    except ValueError as error:
        print(f"parakit export: {error}", file=sys.stderr)
        return 2
    try:
        checkpoint = locate(Path(opts.path), opts.step, Path(opts.config) if opts.config else None)
        given = Path(opts.tokenizer) if opts.tokenizer else None
        tokenizer = None if opts.no_tokenizer else load_tokenizer(checkpoint.cfg, given)
        summary = export(checkpoint, Path(opts.output), tokenizer, max_shard_bytes)
    except (ExportError, FileExistsError, FileNotFoundError, ValueError) as error:
        print(f"parakit export: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # an upstream reader's failure: say which checkpoint, not a traceback
        print(
            f"parakit export: reading {opts.path} failed ({type(error).__name__}: {error}); the checkpoint may be "
            "damaged: try another with --step N",
            file=sys.stderr,
        )
        return 1
    print(
        f"exported {summary['source']} ({summary['backend']}, model {summary['model']}): {summary['parameters']:,} "
        f"parameters in {summary['dtype']}, {len(summary['shards'])} shard(s) -> {opts.output}"
    )
    return 0
