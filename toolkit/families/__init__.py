"""Model families, one module each: everything parakit knows about one Hugging Face architecture
(its config.json in and its transformers config out, its weight names and their mapping to
megatron-core's both ways, how DeepSpeed's pipeline cuts its transformers model) behind the
interface of toolkit.families.base. Adding a family is one module registered here, its value in
toolkit.config.schema.Family, and its tests."""

from __future__ import annotations

from toolkit.families.base import Family
from toolkit.families.gpt2 import GPT2
from toolkit.families.llama import LLAMA, MISTRAL, QWEN2
from toolkit.families.mixtral import MIXTRAL
from toolkit.families.qwen2_moe import QWEN2_MOE
from toolkit.families.qwen3 import QWEN3, QWEN3_MOE

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN2, MISTRAL, GPT2, MIXTRAL, QWEN3, QWEN3_MOE, QWEN2_MOE)}


def family_of(name: str) -> Family:
    """The family registered as `name` (model.family, or config.json's model_type)."""
    try:
        return FAMILIES[str(name)]
    except KeyError:
        raise ValueError(f"model.family={name} is not a known model family (known: {', '.join(FAMILIES)})") from None
