"""A Hugging Face directory's config.json as parakit's model fields (through the family its
model_type names), compared with a configured model; and a configured model as a transformers
config. Pure Python until hf_config builds the transformers object."""

from __future__ import annotations

import os
from pathlib import Path

from toolkit.config.schema import ModelConfig, MoeConfig, as_name, expert_ffn_size, is_moe, plain
from toolkit.families import FAMILIES, family_of
from toolkit.formats.hf_arch import (
    ARCHITECTURE,
    DEFAULT_SEQ_LENGTH,
    HF_PATH_FIX,
    LLAMA3_SCALING,
    MOE_ARCHITECTURE,
    HfConfigError,
    read_config,
)


def hf_config(m: ModelConfig):
    """The transformers PretrainedConfig of a configured model (its family's configuration class).
    A ValueError names what the family's transformers modules cannot express: their model would
    be another one."""
    family = family_of(m.family)
    if unexpressed := family.unexpressed(m):
        settings = "; ".join(f"{field}={u.value} (they {u.why})" for field, u in unexpressed.items())
        raise ValueError(f"transformers' {m.family} modules cannot express {settings}")
    return family.hf_config(m)


def model_fields(path: str | os.PathLike | None) -> dict:
    """The ModelConfig fields of the model in `path` (toolkit.config.schema.ModelConfig names)."""
    c = read_config(path)
    family = FAMILIES.get(c.get("model_type")) if isinstance(c.get("model_type"), str) else None
    if family is None:
        raise HfConfigError(
            f"model.hf_path={path}: model_type {c.get('model_type')!r} is not supported (supported: "
            f"{', '.join(FAMILIES)}); choose a model of a supported family"
        )
    c = _Reads(c)
    try:
        fields = family.fields(c, path)
    except KeyError as e:
        raise HfConfigError(f"model.hf_path={path}: config.json has no {e.args[0]!r}; {HF_PATH_FIX}") from None
    except (TypeError, ValueError, ArithmeticError) as e:  # a value of another type ("64", null, a list)
        raise HfConfigError(
            f"model.hf_path={path}: config.json's {c.suspects()} does not make a model ({e}); {HF_PATH_FIX}"
        ) from None
    if wrong := _wrong_types(fields, c):
        raise HfConfigError(f"model.hf_path={path}: config.json gives {wrong}; {HF_PATH_FIX}")
    positions = fields["max_position_embeddings"]
    # the family's QK norm; model.moe's fields the config gives (none for a dense family) over the schema's defaults
    fields = {**fields, "qk_layernorm": family.qk_layernorm, "moe": {**plain(MoeConfig()), **fields.get("moe", {})}}
    return {
        "name": as_name(Path(str(path)).expanduser().resolve().name),
        "family": family.name,
        "vocab_size": c.get("vocab_size", family.default_vocab_size),
        "tie_embeddings": bool(c.get("tie_word_embeddings", True)),  # PretrainedConfig's default
        "init_method_std": float(c.get("initializer_range", 0.02)),
        "seq_length": min(positions, DEFAULT_SEQ_LENGTH),
        **fields,
    }


class _Reads(dict):
    """config.json's object, remembering which keys a family read, in order: an error names its key."""

    def __init__(self, content: dict):
        super().__init__(content)
        self.read: list[str] = []

    def __getitem__(self, key):
        self.read.append(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.append(key)
        return super().get(key, default)

    def suspects(self) -> str:
        """The keys read whose values are not numbers where a model needs them ("64", null, a list),
        as 'hidden_size="64"'; else the last key read."""
        values = {k: dict.get(self, k) for k in self.read if k in self}
        wrong = [k for k, v in values.items() if v is None or isinstance(v, list) or _numeric_text(v)]
        return ", ".join(f"{k}={values[k]!r}" for k in (wrong or list(values)[-1:]))


def _numeric_text(value) -> bool:
    if not isinstance(value, str):
        return False
    try:
        float(value)
    except ValueError:
        return False
    return True


def _wrong_types(fields: dict, c: _Reads) -> str:
    """The fields config.json gave a value of another type than ModelConfig's (a string for a
    size, a float for a count), each with the config.json key it came from, as
    "num_hidden_layers=[24] (model.num_layers: an integer)"; "" when none."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(ModelConfig)
    wrong = []
    for f in dataclasses.fields(ModelConfig):
        if f.name not in fields:
            continue
        value, kind = fields[f.name], hints[f.name]
        optional = type(None) in typing.get_args(kind)
        number = {int: "an integer", float: "a number"}.get(next((a for a in typing.get_args(kind) or (kind,)), None))
        ok = isinstance(value, (int, float) if number == "a number" else int) and not isinstance(value, bool)
        if number and not ok and not (value is None and optional):
            key = next((k for k in dict.fromkeys(c.read) if k in c and dict.get(c, k) is value), None)
            given = f"{key}={value!r}" if key else f"{value!r}"
            wrong.append(f"{given} (model.{f.name}: {number})")
    return ", ".join(wrong)


def field(name: str, path) -> object:
    """One ModelConfig field of the model in `path` (the `${hf:FIELD,PATH}` resolver); a nested
    field as `rope_scaling.factor`."""
    value = model_fields(path)
    for part in name.split("."):
        value = value[part]
    return value


def _same(ours, theirs) -> bool:
    if isinstance(theirs, dict):
        return isinstance(ours, dict) and ours.keys() == theirs.keys() and all(_same(ours[k], theirs[k]) for k in ours)
    if isinstance(theirs, float) or isinstance(ours, float):
        return ours is not None and theirs is not None and abs(float(ours) - float(theirs)) <= 1e-9 * abs(theirs)
    return str(ours) == str(theirs)


def mismatches(model, path) -> dict[str, tuple]:
    """{field: (configured, in config.json)} for each architecture field where the configured
    model (a ModelConfig) differs from the directory's; {} when they agree."""
    theirs = model_fields(path)
    ours = {name: getattr(model, name) for name in ARCHITECTURE}
    heads = model.num_attention_heads
    ours["num_kv_heads"] = model.num_kv_heads or heads  # None means as many as heads
    ours["head_dim"] = model.head_dim or model.hidden_size // heads
    theirs["num_kv_heads"] = theirs["num_kv_heads"] or theirs["num_attention_heads"]
    theirs["head_dim"] = theirs["head_dim"] or theirs["hidden_size"] // theirs["num_attention_heads"]
    if theirs["position_embedding"] != "rope":
        ours.pop("rotary_base")
    scaling = model.rope_scaling
    ours["rope_scaling"] = (
        {"type": str(scaling.type), **{f: getattr(scaling, f) for f in LLAMA3_SCALING.values()}}
        if scaling.type == "llama3"
        else {"type": "none"}
    )
    ours["moe"] = {name: getattr(model.moe, name) for name in MOE_ARCHITECTURE}
    ours["moe"]["ffn_hidden_size"] = expert_ffn_size(model) if is_moe(model) else None
    theirs["moe"] = {name: theirs["moe"][name] for name in MOE_ARCHITECTURE}
    if theirs["rope_scaling"]["type"] == "none":
        theirs["rope_scaling"] = {"type": "none"}
    differ = [name for name in ARCHITECTURE if name in ours and not _same(ours[name], theirs[name])]
    return {name: (ours[name], theirs[name]) for name in differ}


def describe(diff: dict[str, tuple]) -> str:
    """`model.FIELD=configured vs in config.json, ...`"""
    return ", ".join(f"model.{name}={a} vs {b}" for name, (a, b) in diff.items())


MISMATCH_FIX = "use model=hf model.hf_path={path} (reads the architecture from config.json), or set those fields"


def check_matches(model, path) -> None:
    """Refuse a configured model whose architecture differs from the one in `path`."""
    diff = mismatches(model, path)
    if diff:
        raise HfConfigError(
            f"model.hf_path={path} holds another architecture than model={model.name} (configured vs "
            f"config.json): {describe(diff)}. " + MISMATCH_FIX.format(path=path).capitalize()
        )
