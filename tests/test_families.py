"""The model-family registry: every family the schema names is registered, builds its own
transformers configuration, and no module outside toolkit/families branches on a family's name
(so adding a family is its module, its registration and its tests). What each family maps is
tested through the models it converts (test_hf_weights, test_export, test_params)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from toolkit.config.schema import Family as FamilyName
from toolkit.families import FAMILIES, family_of
from toolkit.families.hf_config import hf_config, model_fields
from toolkit.families.llama import Llama
from toolkit.formats.hf_arch import HfConfigError

PACKAGE = Path(__file__).parents[1] / "toolkit"


def family_branches(root: Path) -> list[str]:
    """`file:line` of each comparison of a `family` name or attribute with a literal, outside the
    families package."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if "families" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            named = any(getattr(s, "attr", getattr(s, "id", None)) == "family" for s in sides)
            literal = any(isinstance(s, (ast.Constant, ast.Tuple, ast.Set, ast.List)) for s in sides)
            if named and literal:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_every_family_of_the_schema_is_registered_once():
    assert set(FAMILIES) == {f.value for f in FamilyName}
    assert all(name == family.name for name, family in FAMILIES.items())


# what a family's transformers modules need beyond the tiny models (toolkit.families.base.Family.unexpressed)
NEEDS = {"qwen2_moe": ["model.moe.shared_expert_size=96", "model.moe.shared_expert_gate=true"]}


@pytest.mark.parametrize("name", [f.value for f in FamilyName])
def test_a_family_builds_its_own_transformers_configuration(compose, name):
    qk = f"model.qk_layernorm={family_of(name).qk_layernorm}"
    tiny = "model=tiny_moe" if family_of(name).moe else "model=tiny"
    m = compose(tiny, f"model.family={name}", qk, *NEEDS.get(name, [])).model
    config = hf_config(m)
    # transformers' own name for the architecture: the model_type its config.json carries
    assert config.model_type == name
    assert config.vocab_size == m.vocab_size


def test_no_module_outside_the_families_branches_on_a_family():
    assert family_branches(PACKAGE) == []


@pytest.mark.mutation
def test_a_planted_family_branch_is_found(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "model.py").write_text('def f(m):\n    return 1 if m.family == "gpt2" else 2\n')
    (tmp_path / "families").mkdir()
    (tmp_path / "families" / "gpt2.py").write_text('def g(family):\n    return family in ("gpt2",)\n')
    assert family_branches(tmp_path) == ["train/model.py:2"]


def test_a_registered_family_is_read_from_config_json(tmp_path, monkeypatch):
    """Registration is what makes a model_type readable: unknown, it is refused with the
    supported list; registered, its module's fields are read."""
    config = {"model_type": "llama_like_test", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    config |= {"intermediate_size": 128, "max_position_embeddings": 256, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HfConfigError, match="model_type 'llama_like_test' is not supported"):
        model_fields(tmp_path)
    monkeypatch.setitem(FAMILIES, "llama_like_test", Llama("llama_like_test"))
    fields = model_fields(tmp_path)
    assert fields["family"] == "llama_like_test"
    assert (fields["num_layers"], fields["hidden_size"], fields["activation"]) == (2, 64, "swiglu")


def test_qwen3_moe_writes_megatron_cores_pattern_of_moe_layers(compose, tmp_path):
    """Every layer_freq-th layer from layer 0 is an MoE layer in megatron-core, every
    decoder_sparse_step-th from layer step-1 in transformers: the config written lists the dense
    layers instead, and reads back as the same pattern."""
    from transformers import Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from toolkit.config.schema import moe_layer_pattern

    m = compose("model=tiny_moe", "model.family=qwen3_moe", "model.qk_layernorm=true", "model.moe.layer_freq=2").model
    m.moe.dense_layers = [2]
    config = family_of("qwen3_moe").hf_config(m)
    model = Qwen3MoeForCausalLM(config)
    sparse = [int(isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)) for layer in model.model.layers]
    assert sparse == moe_layer_pattern(m) == [1, 0, 0, 0]
    config.save_pretrained(tmp_path)
    assert model_fields(tmp_path)["moe"]["dense_layers"] == [1, 2, 3]


def test_a_model_its_family_cannot_express_gets_no_transformers_configuration(compose):
    """A Mixtral that drops tokens over capacity, or a Qwen2-MoE without its shared expert, would
    be another model in transformers: named, not written."""
    with pytest.raises(ValueError, match=r"model.moe.capacity_factor=1.0 \(they drop no token\)"):
        hf_config(compose("model=tiny_moe", "model.moe.capacity_factor=1.0").model)
    with pytest.raises(ValueError, match="model.moe.shared_expert_size=None"):
        hf_config(compose("model=tiny_moe", "model.family=qwen2_moe").model)
