"""The equivalent Megatron-LM `pretrain_gpt.py` command line (megatron_args.txt), flag names as
Megatron-LM core_r0.19.0 defines them (megatron/training/arguments.py).

Megatron-LM builds its TransformerConfig, OptimizerConfig and DistributedDataParallelConfig by
copying the parsed arguments whose names are the dataclasses' fields
(megatron/training/argument_utils.py core_transformer_config_from_args; training.py
get_megatron_optimizer_config, get_megatron_ddp_config). So every field of megatron.yaml's sections
reaches the command line by one rule: the flag of its own name (`--moe-router-topk 2` for
moe_router_topk; a boolean field is a switch given when true), unless FIELDS below says otherwise:
a flag of another name or an inverted switch, flags that only together express the field, a value
Megatron-LM derives from other flags (Implied), or one no flag carries (Unflagged, with the
reason). Every value is written whole, Megatron-LM's default or not, so the file says the plan
whatever a Megatron-LM version defaults to. One flag with its values per line, shell-quoted.
"""

from __future__ import annotations

import itertools
import shlex
from dataclasses import dataclass
from typing import Callable

from toolkit.config.schema import Config
from toolkit.formats.manifest import parse_blend, read_manifest, tokenizer_dir
from toolkit.plan.backends import logs_to
from toolkit.plan.checkpoint import interval_steps, saves_asynchronously
from toolkit.plan.layout import Layout
from toolkit.plan.perf import estimate_step


@dataclass(frozen=True)
class Flag:
    """A field's flag of another name. `when` set: a switch given when the field has that value;
    None: the flag followed by the value, as `words` writes it (default: str; a list item by item)."""

    name: str
    when: bool | None = None
    words: Callable[[object], list[str]] | None = None


@dataclass(frozen=True)
class Implied:
    """No flag of its own: Megatron-LM derives the field from other flags, as `how` says."""

    how: str


@dataclass(frozen=True)
class Unflagged:
    """No flag carries the field to Megatron-LM: `why`."""

    why: str


# (the field's value, every section's fields) -> the flags that express it, each [flag, *values]
Together = Callable[[object, dict], list[list[str]]]


def _layer_pattern(pattern: list[int]) -> list[str]:
    """moe_layer_freq as Megatron-LM's pattern expression (arguments.py moe_freq_type): runs of
    [0] dense and [1] MoE layers, e.g. [0]*1+[1]*31."""
    return ["+".join(f"[{kind}]*{len(list(run))}" for kind, run in itertools.groupby(pattern))]


def _query_groups(groups: int, fields: dict) -> list[list[str]]:
    # Megatron-LM reads --num-query-groups only with --group-query-attention (else one per head)
    if groups == fields["num_attention_heads"]:
        return []
    return [["--group-query-attention"], ["--num-query-groups", str(groups)]]


def _activation(activation: str, fields: dict) -> list[list[str]]:
    # silu is --swiglu's (gated_linear_unit), gelu Megatron-LM's default, gelu_tanh --openai-gelu
    return [["--openai-gelu"]] if activation == "gelu_tanh" else []


def _bias_activation_fusion(fused: bool, fields: dict) -> list[list[str]]:
    # one switch per activation: --no-bias-swiglu-fusion with --swiglu, else --no-bias-gelu-fusion
    if fused:
        return []
    return [["--no-bias-swiglu-fusion" if fields["gated_linear_unit"] else "--no-bias-gelu-fusion"]]


def _grad_reduce(fp32: bool, fields: dict) -> list[list[str]]:
    # Megatron-LM turns fp32 accumulation and reduction on for bf16 unless --grad-reduce-in-bf16
    # (validate_args), so leaving the first flag out is not enough
    if fp32:
        return [["--accumulate-allreduce-grads-in-fp32"]]
    return [["--grad-reduce-in-bf16"]] if fields["bf16"] else []


FIELDS: dict[str, Flag | Together | Implied | Unflagged] = {
    # model_parallel
    "virtual_pipeline_model_parallel_size": Flag("--num-virtual-stages-per-pipeline-rank"),
    "params_dtype": Implied("--bf16 or --fp16 (validate_args)"),
    "pipeline_dtype": Implied("params_dtype (core_transformer_config_from_args)"),
    "perform_initialization": Flag("--no-initialization", when=False),
    "gradient_accumulation_fusion": Flag("--no-gradient-accumulation-fusion", when=False),
    "overlap_p2p_comm": Flag("--no-overlap-p2p-communication", when=False),
    "batch_p2p_comm": Unflagged(
        "Megatron-LM sets it to not overlap_p2p_comm (core_transformer_config_from_args), as parakit does on "
        "GPUs; on CPU parakit sends one at a time (gloo pairs batched sends wrongly), which pretrain_gpt.py, "
        "CUDA only, has no flag for"
    ),
    "deallocate_pipeline_outputs": Implied("always on (core_transformer_config_from_args)"),
    # transformer
    "num_layers_in_first_pipeline_stage": Flag("--decoder-first-pipeline-num-layers"),
    "num_layers_in_last_pipeline_stage": Flag("--decoder-last-pipeline-num-layers"),
    "num_query_groups": _query_groups,
    "layernorm_epsilon": Flag("--norm-epsilon"),
    "add_bias_linear": Flag("--disable-bias-linear", when=False),
    "gated_linear_unit": Flag("--swiglu", when=True),
    "window_size": Flag("--window-size", words=lambda w: [f"{w[0]},{w[1]}"]),  # arguments.py tuple_type
    "activation_func": _activation,
    "bias_activation_fusion": _bias_activation_fusion,
    "masked_softmax_fusion": Flag("--no-masked-softmax-fusion", when=False),
    "bias_dropout_fusion": Flag("--no-bias-dropout-fusion", when=False),
    "apply_rope_fusion": Flag("--no-rope-fusion", when=False),
    "persist_layer_norm": Flag("--no-persist-layer-norm", when=False),
    "fp8": Flag("--fp8-format"),
    "num_moe_experts": Flag("--num-experts"),
    "moe_layer_freq": Flag("--moe-layer-freq", words=_layer_pattern),
    # ddp
    "grad_reduce_in_fp32": _grad_reduce,
    "bucket_size": Flag("--ddp-bucket-size"),
    "check_for_nan_in_grad": Unflagged(
        "off for parakit's trainer, which checks loss and gradients on every rank itself "
        "(train.fault.nan_action); under pretrain_gpt.py Megatron-LM's own check, on by default, does that"
    ),
    # scheduler (training.py get_optimizer_param_scheduler; in iterations, as parakit steps it)
    "init_lr": Flag("--lr-warmup-init"),
    "max_lr": Flag("--lr"),
    "lr_warmup_steps": Flag("--lr-warmup-iters"),
    "lr_decay_steps": Flag("--lr-decay-iters"),
    "start_wd": Implied("--weight-decay under the constant increment style (validate_args refuses it then)"),
    "end_wd": Implied("--weight-decay under the constant increment style (validate_args refuses it then)"),
    "wd_incr_steps": Implied("--train-iters"),
    "wd_incr_style": Flag("--weight-decay-incr-style"),
    # gpt_model (argument_utils.py gpt_config_from_args)
    # given, Megatron-LM keeps it instead of padding the tokenizer's vocabulary itself
    # (megatron/core/tokenizers/utils/build_tokenizer.py _set_padded_vocab_size): parakit's embedding rows
    "vocab_size": Flag("--padded-vocab-size"),
    "max_sequence_length": Flag("--max-position-embeddings"),
    "rotary_base": Flag("--rotary-base", words=lambda base: [str(int(base))]),  # an int flag
    "rope_scaling": Flag("--use-rope-scaling", when=True),
    "share_embeddings_and_output_weights": Flag("--untie-embeddings-and-output-weights", when=False),
    "parallel_output": Implied("always on (gpt_builders.py)"),
    # training
    "world_size": Unflagged("the launcher's: launch.sh's torchrun --nnodes x --nproc-per-node"),
    "data_parallel_size": Implied("world size / (tp x pp x cp) (validate_args)"),
    "num_microbatches": Implied("--global-batch-size / (--micro-batch-size x dp)"),
}


def _flags(name: str, value, fields: dict) -> list[list[str]]:
    """The flags (each [flag, *values]) one field becomes."""
    how = FIELDS.get(name)
    if isinstance(how, (Implied, Unflagged)) or (how is None and value is None):
        return []
    if callable(how):
        return how(value, fields)
    if how is None:  # the flag of the field's own name
        how = Flag("--" + name.replace("_", "-"), when=True if isinstance(value, bool) else None)
    if how.when is not None:
        return [[how.name]] if value == how.when else []
    if value is None:
        return []
    words = how.words(value) if how.words else [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return [[how.name, *words]]


def section_flags(sections: dict) -> list[list[str]]:
    """Every field of megatron.yaml's sections as Megatron-LM flags, in the sections' order. A field
    in two sections (bf16, lr, use_distributed_optimizer, ...) gives its flag once; two sections that
    disagree on it are a bug in parakit."""
    fields = {name: value for section in sections.values() for name, value in section.items()}
    flags: dict[str, list[str]] = {}
    for section in sections.values():
        for name, value in section.items():
            for flag in _flags(name, value, fields):
                if flags.setdefault(flag[0], flag) != flag:
                    raise AssertionError(f"megatron.yaml's sections disagree on {flag[0]}: {flags[flag[0]]} and {flag}")
    return list(flags.values())


def _data_flags(cfg: Config, layout: Layout) -> list[list[str]]:
    """Tokenizer, data, evaluation, logging, profiling and the stop signal: the run's, not megatron.yaml's."""
    # A prepared dataset carries its tokenizer's files (PREFIX.tokenizer): Megatron-LM reads them, so
    # that its end-of-document id is the one the documents end with. Else token ids below the model's
    # vocabulary, the last one ending a document (NullTokenizer).
    prefix = parse_blend(cfg.data.path)[0][0] if cfg.data.name == "corpus" and cfg.data.path else None
    if prefix and read_manifest(prefix):
        flags = [["--tokenizer-type", "HuggingFaceTokenizer"], ["--tokenizer-model", str(tokenizer_dir(prefix))]]
    else:
        flags = [["--tokenizer-type", "NullTokenizer"], ["--vocab-size", str(cfg.model.vocab_size)]]
    if cfg.data.name == "corpus" and cfg.data.path:
        flags += [["--data-path", *cfg.data.path.split()], ["--split", cfg.data.split]]
    else:
        flags.append(["--mock-data"])
    flags.append(["--num-workers", str(layout.loader_workers)])
    # Megatron-LM divides --train-iters by --eval-interval whether it evaluates or not (training.py
    # get_train_valid_test_num_samples: no default, a TypeError at start). Without evaluation: one interval
    # of the whole run, of no iterations.
    every = cfg.train.eval_interval
    flags += [
        ["--eval-interval", str(every or layout.steps)],
        ["--eval-iters", str(cfg.train.eval_iters if every else 0)],
    ]
    start = cfg.train.profile_step_start
    if start is not None:  # torch.profiler on rank 0 over the same steps (training.py, its schedule
        # records steps profile_step_start to profile_step_end - 1 into --tensorboard-dir)
        end = cfg.train.profile_step_end or start + 1
        flags += [["--profile"], ["--use-pytorch-profiler"], ["--profile-ranks", "0"]]
        flags += [["--profile-step-start", str(start)], ["--profile-step-end", str(end)]]
    if cfg.train.fault.save_on_stop:  # SIGTERM: save after the iteration, then exit (training.py)
        flags.append(["--exit-signal-handler"])
    # parakit's save: fully parallel (Megatron-LM's default), the distributed optimizer
    # dp_reshardable (its default too) unless asked to be loadable at any layout
    if cfg.checkpoint.reshardable:
        flags.append(["--dist-ckpt-optim-fully-reshardable"])
    if saves_asynchronously(cfg):
        flags.append(["--async-save"])
    return flags


def _tracking_flags(cfg: Config, layout: Layout) -> list[list[str]]:
    """How often Megatron-LM saves, and its W&B project; the paths (--save, --load, --tensorboard-dir,
    --wandb-save-dir) and the run's name are the run directory's, which launch.sh adds
    (toolkit.emit.launch.megatron_lm_run_flags)."""
    flags = []
    if (every := save_interval(cfg, layout)) is not None:
        flags.append(["--save-interval", str(every)])
    if logs_to(cfg, "wandb"):
        flags.append(["--wandb-project", cfg.train.tracker_project])
        if cfg.train.wandb_entity:
            flags.append(["--wandb-entity", cfg.train.wandb_entity])
    return flags


def save_interval(cfg: Config, layout: Layout) -> int | None:
    """Megatron-LM's --save-interval for checkpoint.*: None where parakit would not save."""
    return interval_steps(cfg, layout, estimate_step(cfg, layout).step_time)


def megatron_args(cfg: Config, layout: Layout, sections: dict) -> list[str]:
    """Megatron-LM's pretrain_gpt.py command line for the same run (megatron_args.txt), from the
    sections megatron.yaml holds, so that both files say the same: one flag with its values per
    entry, shell-quoted (shlex.split reads an entry back into the words Megatron-LM gets)."""
    flags = section_flags(sections) + _data_flags(cfg, layout) + _tracking_flags(cfg, layout)
    return [shlex.join(flag) for flag in flags]
