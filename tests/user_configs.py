"""A team's own config directory, kept outside the package: a model and a recipe that uses it."""

from pathlib import Path

MODEL = """\
# A team model: fields not given keep the schema's defaults.
name: my_model
num_layers: 4
hidden_size: 64
num_attention_heads: 4
ffn_hidden_size: 128
"""

RECIPE = """\
# @package _global_
defaults:
  - override /model: my_model
  - override /cluster: cpu
train:
  global_batch: 8
"""


def write_user_configs(root: Path) -> Path:
    """root/model/my_model.yaml and root/recipe/my_recipe.yaml; returns root."""
    (root / "model").mkdir(parents=True, exist_ok=True)
    (root / "recipe").mkdir(parents=True, exist_ok=True)
    (root / "model" / "my_model.yaml").write_text(MODEL)
    (root / "recipe" / "my_recipe.yaml").write_text(RECIPE)
    return root
