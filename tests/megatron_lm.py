"""Megatron-LM's reading of a megatron_args.txt, without a Megatron-LM checkout.

Its argparse parser is rebuilt from tests/data/megatron_lm_args.json (every option of
pretrain_gpt.py at core_r0.19.0, read from the parser by tests/data/megatron_lm_args.py). What
pretrain_gpt.py then makes of the arguments is written out here from Megatron-LM's source, cited
per line: the values validate_args (megatron/training/arguments.py) sets among those parakit sets,
and how core_transformer_config_from_args and gpt_config_from_args (argument_utils.py),
get_megatron_optimizer_config, get_megatron_ddp_config and get_optimizer_param_scheduler
(training.py) and the GPT builder (gpt_builders.py) fill each field. `sections` gives them under
megatron.yaml's names, so the two can be compared field by field. Checked against a Megatron-LM
checkout's own functions over every shipped GPU recipe: every field equal.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
from pathlib import Path

DATA = json.loads((Path(__file__).parent / "data" / "megatron_lm_args.json").read_text())
FLAGS = {flag for option in DATA["options"] for flag in option["flags"]}


def _pattern(text: str):
    """arguments.py moe_freq_type: an int, or a list expression of digits, [], (), + and *."""
    if "[" not in text:
        return int(text)
    if re.search(r"[^,\d\[\]()+*]", text):
        raise ValueError(f"Invalid pattern: {text}")
    return eval(text)  # the characters are checked above, as Megatron-LM's _eval_pattern does


TYPES = {
    "int": int,
    "float": float,
    "str": str,
    "moe_freq_type": _pattern,
    "tuple_type": lambda text: tuple(int(i) for i in text.strip("()").split(",")),  # arguments.py tuple_type
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(f"Megatron-LM's parser refuses the command line: {message}")


def parser() -> argparse.ArgumentParser:
    """Megatron-LM's parser: each option's flags, destination, action, default, nargs, type and
    choices (an enum option keeps its member's name)."""
    p = _Parser(allow_abbrev=False)
    for o in DATA["options"]:
        kw = {"dest": o["dest"], "default": o["default"]}
        if o["action"] in ("store_true", "store_false"):
            p.add_argument(*o["flags"], action=o["action"], **kw)
        elif o["action"] == "BooleanOptionalAction":  # it adds the --no- flag itself
            p.add_argument(
                *(f for f in o["flags"] if not f.startswith("--no-")), action=argparse.BooleanOptionalAction, **kw
            )
        elif o["action"] == "store_const":
            p.add_argument(*o["flags"], action="store_const", const=o["const"], **kw)
        else:
            p.add_argument(*o["flags"], action=o["action"], nargs=o["nargs"], type=TYPES.get(o["type"], str), **kw)
    return p


PARSER = parser()


def words(megatron_args_txt: str) -> list[str]:
    """The command line launch.sh hands pretrain_gpt.py: the file's shell words, as its shlex reads them."""
    return shlex.split(megatron_args_txt)


def _validated(argv: list[str], world_size: int) -> argparse.Namespace:
    a = PARSER.parse_args(argv)
    # validate_args: the values it sets that parakit sets too (megatron/training/arguments.py)
    a.data_parallel_size = world_size // (
        a.tensor_model_parallel_size * a.pipeline_model_parallel_size * a.context_parallel_size
    )
    vpp = a.num_virtual_stages_per_pipeline_rank
    a.virtual_pipeline_model_parallel_size = None if vpp in (None, 1) else vpp
    if a.virtual_pipeline_model_parallel_size is None:
        a.overlap_p2p_comm = False  # "non-interleaved schedule does not support overlapping p2p"
    if a.expert_tensor_parallel_size is None:
        a.expert_tensor_parallel_size = a.tensor_model_parallel_size
    if a.kv_channels is None:
        a.kv_channels = a.hidden_size // a.num_attention_heads
    a.params_dtype = "bfloat16" if a.bf16 else "float16" if a.fp16 else "float32"
    if a.bf16:  # "bfloat16 requires gradient accumulation and all-reduce to be done in fp32"
        a.accumulate_allreduce_grads_in_fp32 = not a.grad_reduce_in_bf16 and (
            a.accumulate_allreduce_grads_in_fp32 or a.main_grads_dtype == "fp32"
        )
    if a.position_embedding_type != "rope":
        a.apply_rope_fusion = False
    if a.num_experts == 0:
        a.num_experts = None
    if a.num_experts is not None and a.moe_ffn_hidden_size is None:
        a.moe_ffn_hidden_size = a.ffn_hidden_size
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        if isinstance(getattr(a, name), list) and len(getattr(a, name)) == 1:
            setattr(a, name, getattr(a, name)[0])
    if a.weight_decay_incr_style == "constant":
        a.start_weight_decay = a.end_weight_decay = a.weight_decay
    if a.lr_decay_iters is None:  # training.py get_optimizer_param_scheduler
        a.lr_decay_iters = a.train_iters
    return a


def _padded_vocab(a: argparse.Namespace) -> int:
    """Without --padded-vocab-size Megatron-LM pads the tokenizer's vocabulary to a multiple of
    --make-vocab-size-divisible-by x tp (megatron/core/tokenizers/utils/build_tokenizer.py)."""
    if a.vocab_size is None:
        raise ValueError(f"the vocabulary is {a.tokenizer_type}'s own: no --vocab-size or --padded-vocab-size")
    multiple = a.make_vocab_size_divisible_by * a.tensor_model_parallel_size
    return math.ceil(a.vocab_size / multiple) * multiple


# megatron.yaml's field -> what pretrain_gpt.py sets it to from the validated arguments, where that is
# not the argument of the field's own name (which Megatron-LM copies into the dataclasses by name).
READ = {
    # core_transformer_config_from_args
    "pipeline_dtype": lambda a: a.params_dtype,
    "persist_layer_norm": lambda a: not a.no_persist_layer_norm,
    "batch_p2p_comm": lambda a: not a.overlap_p2p_comm,
    "deallocate_pipeline_outputs": lambda a: True,
    "num_layers_in_first_pipeline_stage": lambda a: a.decoder_first_pipeline_num_layers,
    "num_layers_in_last_pipeline_stage": lambda a: a.decoder_last_pipeline_num_layers,
    "num_query_groups": lambda a: a.num_query_groups if a.group_query_attention else None,
    "gated_linear_unit": lambda a: a.swiglu,
    "activation_func": lambda a: "silu" if a.swiglu else "gelu_tanh" if a.openai_gelu else "gelu",
    "bias_activation_fusion": lambda a: a.bias_swiglu_fusion if a.swiglu else a.bias_gelu_fusion,
    "cp_comm_type": lambda a: a.cp_comm_type[0] if len(a.cp_comm_type) == 1 else a.cp_comm_type,
    "num_moe_experts": lambda a: a.num_experts,
    # get_megatron_ddp_config
    "grad_reduce_in_fp32": lambda a: a.accumulate_allreduce_grads_in_fp32,
    "check_for_nan_in_grad": lambda a: a.check_for_nan_in_loss_and_grad,
    "bucket_size": lambda a: a.ddp_bucket_size,
    # get_optimizer_param_scheduler, in iterations (it counts samples: both sides times the global batch)
    "init_lr": lambda a: a.lr_warmup_init,
    "max_lr": lambda a: a.lr,
    "lr_warmup_steps": lambda a: a.lr_warmup_iters,
    "lr_decay_steps": lambda a: a.lr_decay_iters,
    "start_wd": lambda a: a.start_weight_decay,
    "end_wd": lambda a: a.end_weight_decay,
    "wd_incr_steps": lambda a: a.train_iters,
    "wd_incr_style": lambda a: a.weight_decay_incr_style,
    # gpt_builders.py and vocab_utils.py
    "vocab_size": lambda a: a.padded_vocab_size or _padded_vocab(a),
    "max_sequence_length": lambda a: a.max_position_embeddings,
    "rope_scaling": lambda a: a.use_rope_scaling,
    "rope_scaling_factor": lambda a: a.rope_scaling_factor if a.use_rope_scaling else None,
    "share_embeddings_and_output_weights": lambda a: not a.untie_embeddings_and_output_weights,
    "parallel_output": lambda a: True,
    # the launcher's world, and Megatron-LM's microbatch calculator
    "num_microbatches": lambda a: a.global_batch_size // (a.micro_batch_size * a.data_parallel_size),
}


def sections(megatron_args_txt: str, like: dict, world_size: int) -> dict:
    """What Megatron-LM sets each field of megatron.yaml's sections (`like`) to, reading this
    megatron_args.txt on `world_size` ranks."""
    a = _validated(words(megatron_args_txt), world_size)
    a.world_size = world_size
    return {
        name: {field: READ[field](a) if field in READ else getattr(a, field) for field in fields}
        for name, fields in like.items()
    }


def differences(megatron_args_txt: str, ours: dict, world_size: int) -> list[str]:
    """Each field of megatron.yaml's sections (`ours`) whose value Megatron-LM, reading this
    megatron_args.txt, sets otherwise: the transformer, optimizer and DDP fields as megatron-core's
    classes hold them once built from either side (their defaults filled in the same way), the rest
    as plain values. The fields no flag carries (toolkit.emit.megatron_args Unflagged) are skipped."""
    from upstream import megatron_accepts

    from toolkit.emit.megatron_args import FIELDS, Unflagged

    theirs = sections(megatron_args_txt, ours, world_size)
    found = []
    try:
        built = dict(zip(("transformer", "optimizer", "ddp"), zip(megatron_accepts(ours), megatron_accepts(theirs))))
    except (ValueError, AssertionError) as e:  # then the plain values say which field
        found.append(f"megatron-core refuses the configuration Megatron-LM reads: {e}")
        built = {}
    for section, fields in ours.items():
        for field, value in fields.items():
            if isinstance(FIELDS.get(field), Unflagged):
                continue
            objects = built.get("transformer" if section == "model_parallel" else section)
            mine, megatron_lm = (getattr(o, field) for o in objects) if objects else (value, theirs[section][field])
            if isinstance(mine, bool) and megatron_lm is None:  # an unset switch
                megatron_lm = False
            if mine != megatron_lm:
                found.append(f"{section}.{field}: megatron.yaml {mine!r}, Megatron-LM {megatron_lm!r}")
    return found
