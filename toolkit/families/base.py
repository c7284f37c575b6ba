"""What a model family knows, as one interface: a family module (toolkit/families/llama.py,
gpt2.py) implements it for one Hugging Face architecture.

A family translates between three names for the same weights: the Hugging Face checkpoint's
(transformers' modeling_*.py), megatron-core's GPTModel (its state dict and checkpoint keys:
megatron/core/models/gpt/gpt_layer_specs.py) and the stage modules DeepSpeed's PipelineModule
partitions (toolkit.train.deepspeed_pipe). No torch at import: the planner reads families
without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.config.schema import ModelConfig


@dataclass
class PipelineParts:
    """A transformers causal LM cut into what a pipeline partitions: the embeddings, the decoder
    layers (and the rotary module they share, if any), the final norm and the output head."""

    tokens: object
    positions: object | None
    layers: list
    rotary: object | None
    norm: object
    head: object


class Family:
    name: str  # config.json's model_type, and model.family
    default_vocab_size: int  # transformers' default when config.json leaves it out
    layers_prefix: str  # the decoder layers' names: f"{layers_prefix}.{i}."
    embedding_name: str  # the token embedding
    positions_name: str | None = None  # learned absolute position embeddings
    final_norm: str  # prefix of the final norm's weight (and bias)
    norm_bias: bool = False
    qk_layernorm = False  # an RMSNorm over each head's queries and keys (model.qk_layernorm)
    experts = None  # an MoE family's tensor names of a layer (toolkit.families.experts.ExpertNames)

    @property
    def moe(self) -> bool:
        """Whether its models are mixtures of experts (and only they)."""
        return self.experts is not None

    # --- config.json in, transformers config out
    def fields(self, c: dict, path) -> dict:
        """The architecture fields of toolkit.config.schema.ModelConfig from a config.json dict."""
        raise NotImplementedError

    def hf_config(self, m: ModelConfig):
        """The transformers PretrainedConfig of the same architecture (unpadded vocabulary)."""
        raise NotImplementedError

    def unexpressed(self, m: ModelConfig) -> dict:
        """The model's settings (schema field -> toolkit.families.experts.Unexpressed) that this
        family's transformers modules do not express: a backend that trains those modules cannot
        honour them."""
        return {}

    def names_on_disk(self, names: set[str], m: ModelConfig) -> set[str]:
        """The tensor names a checkpoint of this family holds for a transformers model whose
        state dict has `names` (they differ where transformers fuses what the files keep apart)."""
        if self.experts is None:
            return names
        from toolkit.families.experts import names_on_disk

        return names_on_disk(names, self.experts, m.moe.num_experts)

    def on_disk(self, name: str, tensor) -> dict:
        """One tensor of the transformers model in memory -> {its name on disk: tensor} (several
        where transformers fuses what the family's files keep apart: the experts)."""
        if self.experts is None:
            return {name: tensor}
        from toolkit.families.experts import unfused_on_disk

        return unfused_on_disk(name, tensor, self.experts)

    # --- weights: megatron-core -> Hugging Face
    def layer_prefix(self, i: int) -> str:
        return f"{self.layers_prefix}.{i}."

    def layer_to_hf(self, src: dict, i: int, m: ModelConfig) -> dict:
        """Layer i's megatron tensors (local-spec names without "decoder.layers.{i}.") -> its
        Hugging Face tensors; each tensor used is popped from `src`."""
        raise NotImplementedError

    def outer_to_hf(self, name: str, tensor, m: ModelConfig) -> dict:
        """One megatron tensor outside the layers -> {Hugging Face name: tensor}; the output layer
        of a model with tied embeddings maps to nothing (transformers ties lm_head itself)."""
        if name == "embedding.word_embeddings.weight":
            return {self.embedding_name: tensor[: m.vocab_size]}
        if name == "embedding.position_embeddings.weight" and self.positions_name:
            return {self.positions_name: tensor}
        if name.startswith("decoder.final_layernorm."):
            return {self.final_norm + name.rsplit(".", 1)[1]: tensor}
        if name == "output_layer.weight":
            return {} if m.tie_embeddings else {"lm_head.weight": tensor[: m.vocab_size]}
        raise ValueError(f"no transformers place for megatron tensor {name} (model {m.name})")

    # --- weights: Hugging Face -> megatron-core
    def vocab_name(self, key: str, m: ModelConfig) -> str:
        """The Hugging Face tensor of the embedding or the output layer (the embedding when tied)."""
        tied = key == "embedding.word_embeddings.weight" or m.tie_embeddings
        return self.embedding_name if tied else "lm_head.weight"

    def megatron_tensor(self, key: str, layer: int | None, hf, m: ModelConfig, expert: int | None = None):
        """The global megatron-core tensor of checkpoint key `key` (of decoder layer `layer`, and of
        its expert `expert` for an MoE layer's experts) from the Hugging Face tensors
        (`hf.get(name)`), or None where the family has no counterpart."""
        raise NotImplementedError

    # --- DeepSpeed's pipeline
    def pipeline_parts(self, model) -> PipelineParts:
        raise NotImplementedError

    def pipeline_names(self) -> tuple[dict[str, str], dict[str, str]]:
        """Hugging Face names of the first and the last pipeline layer's parameters (embedding;
        final norm and head), by their names inside those pipeline layers."""
        first = {"tokens.weight": self.embedding_name}
        if self.positions_name:
            first["positions.weight"] = self.positions_name
        last = {"norm.weight": self.final_norm + "weight", "head.weight": "lm_head.weight"}
        if self.norm_bias:
            last["norm.bias"] = self.final_norm + "bias"
        return first, last
