"""The branches parakit takes when CUDA is present, driven on this CPU machine with torch.cuda
patched to report a device: what they build, as JSON on the last line of stdout.

1. megatron-core made ready on a "GPU" without TE or apex: no CPU compatibility layer, and the
   resume fixes for torch's Adam installed all the same.
2. The model chunks on that GPU: the local spec with SDPA core attention, torch norms that mark
   their weights sequence-parallel, every chunk moved to the GPU (built under the CPU layer, which
   maps the device to the CPU, with the GPU branch of build_model_chunks spied on).
3. A mixture of experts there: MoE layers of the same local spec.
4. Transformer Engine reported: the TE layer specs parakit asks for, and the block's final norm.
"""

import json
import os

import torch

real_is_available = torch.cuda.is_available
torch.cuda.is_available = lambda: True

from toolkit.train import mcore_cpu, megatron_backend  # noqa: E402

facts = {}
megatron_backend.prepare_megatron()
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402

facts["cpu_layer_entered"] = mcore_cpu._mode is not None
facts["torch_adam_resume_fixes"] = bool(getattr(DistributedOptimizer, "_parakit_torch_adam", False))

# 2: build under the CPU layer (tensors land on the CPU), with the GPU branch taken.
torch.cuda.is_available = real_is_available
mcore_cpu.enable()
torch.cuda.is_available = lambda: True
moved = []
module_cuda = torch.nn.Module.cuda


def spy_cuda(self, device=None):
    moved.append(type(self).__name__)
    return module_cuda(self, device)


torch.nn.Module.cuda = spy_cuda

from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

from toolkit.config.store import compose_config  # noqa: E402
from toolkit.emit.megatron import megatron_sections  # noqa: E402
from toolkit.plan.layout import resolve  # noqa: E402
from toolkit.train.megatron_model import build_model_chunks  # noqa: E402

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
torch.distributed.init_process_group("gloo")
parallel_state.initialize_model_parallel(1, 1)
model_parallel_cuda_manual_seed(0)
cfg = compose_config(["model=tiny", "cluster=1xh200", "precision=fp32", "model.num_layers=2"])  # as emitted for a GPU
(chunk,) = build_model_chunks(megatron_sections(cfg, resolve(cfg)))
layer = chunk.decoder.layers[0]
facts["core_attention"] = type(layer.self_attention.core_attention).__name__
facts["norms"] = sorted(
    {type(m).__name__ for m in (layer.input_layernorm, layer.pre_mlp_layernorm, chunk.decoder.final_layernorm)}
)
facts["norm_weights_marked"] = all(hasattr(p, "sequence_parallel") for p in layer.input_layernorm.parameters())
facts["chunks_moved_to_gpu"] = moved.count("GPTModel")
facts["attention_backend"] = chunk.config.attention_backend.name
facts["nvte"] = {k: os.environ.get(k) for k in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN")}

# 3: a mixture of experts on that GPU without TE: its MoE layers take the same local spec (SDPA,
# torch norms), and megatron-core's MoELayer with sequential experts.
moe_cfg = compose_config(["model=tiny_moe", "cluster=1xh200", "precision=fp32", "model.num_layers=2"])
(moe_chunk,) = build_model_chunks(megatron_sections(moe_cfg, resolve(moe_cfg)))
moe_layer = moe_chunk.decoder.layers[0]
facts["moe_mlp"] = [type(moe_layer.mlp).__name__, type(moe_layer.mlp.experts).__name__]
facts["moe_core_attention"] = type(moe_layer.self_attention.core_attention).__name__
facts["moe_norms"] = sorted({type(m).__name__ for m in (moe_layer.pre_mlp_layernorm, moe_chunk.decoder.final_layernorm)})

# 4: with Transformer Engine reported: the TE layer specs asked for (dense and MoE layers, QK norm,
# grouped GEMM) and the block's final norm (TE's spec fuses the input norm: IdentityOp there).
from megatron.core.models.gpt import gpt_layer_specs  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402

from toolkit.train import megatron_configs, megatron_model  # noqa: E402

asked = []


def te_spec(**kwargs):
    asked.append(kwargs)
    return ModuleSpec(module=object, submodules=gpt_layer_specs.TransformerLayerSubmodules(input_layernorm=IdentityOp))


gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec = te_spec
megatron_model.have_transformer_engine = lambda: True
te_cfg = compose_config(
    [
        "model=tiny_moe",
        "model.family=qwen3_moe",
        "model.qk_layernorm=true",
        "model.moe.dense_layers=[1]",
        "model.moe.grouped_gemm=true",
        "cluster=1xh200",
        "precision=fp32",
    ]
)
te_config, _, _ = megatron_configs.build_megatron_configs(megatron_sections(te_cfg, resolve(te_cfg)))
specs = megatron_model.decoder_layer_specs(te_config)
block = megatron_model._block_spec(te_config, specs, None)
facts["te_specs_asked"] = asked
facts["te_layers"] = ["moe" if s is specs[0] else "dense" for s in block.layer_specs]
facts["te_final_norm"] = block.layer_norm.__name__
parallel_state.destroy_model_parallel()
torch.distributed.destroy_process_group()
print(json.dumps(facts))
