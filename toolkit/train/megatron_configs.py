"""The megatron-core configuration objects (TransformerConfig, OptimizerConfig,
DistributedDataParallelConfig) built from the plain sections of toolkit.emit.megatron: the same
values megatron.yaml holds, so the trainer runs exactly what `parakit generate` wrote."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GeLU's tanh approximation: GPT-2's gelu_new (transformers NewGELUActivation), Megatron-LM's
    --openai-gelu (megatron-core's openai_gelu, which is torch-compiled: not on CPU here)."""
    return F.gelu(x, approximate="tanh")


def build_megatron_configs(sections: dict):
    """(TransformerConfig, OptimizerConfig, DistributedDataParallelConfig) from the sections."""
    from toolkit.compat import import_shims

    import_shims()
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    def dtypes(section: dict) -> dict:
        return {k: getattr(torch, v) if k.endswith("_dtype") and isinstance(v, str) else v for k, v in section.items()}

    transformer = {**dtypes(sections["model_parallel"]), **sections["transformer"]}
    transformer["activation_func"] = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": gelu_tanh}[
        transformer["activation_func"]
    ]
    transformer["attention_backend"] = AttnBackend[transformer["attention_backend"]]
    if transformer.get("window_size") is not None:  # YAML gives a list
        transformer["window_size"] = tuple(transformer["window_size"])
    return (
        TransformerConfig(**transformer),
        OptimizerConfig(**dtypes(sections["optimizer"])),
        DistributedDataParallelConfig(**sections["ddp"]),
    )
