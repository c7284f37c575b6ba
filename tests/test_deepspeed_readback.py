"""DeepSpeed reads every key of deepspeed.json back to the value the configuration asks for
(tests/deepspeed_readback.py): every shipped recipe on both backends, and the settings the recipes
leave at their defaults (ZeRO++, fp16 loss scaling, bf16 gradients, offload, recompute with a pipeline)."""

import logging

import pytest
from deepspeed_readback import check_deepspeed_readback
from upstream import deepspeed_accepts

from toolkit.config.store import compose_config, conf_dir
from toolkit.emit.deepspeed import deepspeed_config
from toolkit.plan.validate import ValidationError, check

logging.getLogger("DeepSpeed").setLevel(logging.WARNING)

RECIPES = sorted(path.stem for path in (conf_dir() / "recipe").glob("*.yaml"))
GPU = ["cluster=h100_cluster", "model=llama3_8b", "backend=deepspeed", "checks.memory=off", "train.global_batch=512"]
CPU = ["recipe=tiny_cpu_zero3", "checks.memory=off"]
CASES = {
    "zeropp": [
        *GPU,
        "zero=3",
        "comm.hpz_partition_size=2",
        "comm.quantized_weights=true",
        "comm.quantized_gradients=true",
    ],
    "fp16_static": [*GPU, "zero=2", "precision=fp16", "precision.loss_scaling=static", "precision.loss_scale=1024"],
    "fp16_dynamic": [
        *GPU,
        "zero=1",
        "precision=fp16",
        "precision.initial_scale_power=12",
        "precision.loss_scale_window=500",
        "precision.hysteresis=3",
        "precision.min_loss_scale=2",
    ],
    "bf16_zero0_grads_bf16": [*GPU, "zero=0", "precision=bf16", "precision.grad_reduce_in_fp32=false"],
    "bf16_zero3_grads_bf16": [*GPU, "zero=3", "precision=bf16", "precision.grad_reduce_in_fp32=false"],
    "offload_cpu": [*GPU, "zero=3_offload"],
    "offload_nvme": [
        *GPU,
        "zero=3",
        "zero.offload_optimizer=nvme",
        "zero.offload_param=nvme",
        "zero.nvme_path=/local_nvme/ds_offload",
    ],
    "offload_cpu_cluster": [*CPU, "zero=2_offload"],
    "zero_settings": [
        *GPU,
        "zero=2",
        "zero.overlap_comm=false",
        "zero.reduce_bucket_size=20000000",
        "zero.allgather_bucket_size=30000000",
        "optim.beta2=0.999",
        "optim.eps=1e-6",
        "optim.weight_decay=0.01",
        "optim.clip_grad=0.5",
        "optim.lr_scaling=sqrt",
        "optim.reference_global_batch=256",
        "train.log_interval=10",
    ],
    "zero3_settings": [
        *GPU,
        "zero=3",
        "zero.stage3_prefetch_bucket_size=1000000",
        "zero.stage3_param_persistence_threshold=1000",
        "zero.stage3_max_live_parameters=2000000",
    ],
    "pipeline_full_recompute": [*CPU, "zero=1", "parallel.pp=2", "recompute=full", "recompute.num_layers=2"],
}


def _reads_back(cfg, layout) -> None:
    ds_json = deepspeed_config(cfg, layout)
    check_deepspeed_readback(cfg, layout, ds_json, deepspeed_accepts(ds_json, dp=layout.dp, mp=layout.tp * layout.pp))


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_reads_back(recipe, backend):
    """Skipped where the validator rejects a recipe on the other backend than its own (tensor
    parallel on deepspeed, ZeRO-3 on megatron, ...): no configuration there, nothing asked."""
    cfg = compose_config([f"recipe={recipe}", "checks.memory=off", f"backend={backend}"])
    try:
        layout, _ = check(cfg)
    except ValidationError as e:
        if compose_config([f"recipe={recipe}"]).backend.name == backend:
            raise  # a recipe is valid on its own backend
        pytest.skip(f"the validator rejects {recipe} on {backend}: {sorted({v.rule for v in e.report.errors})}")
    _reads_back(cfg, layout)


@pytest.mark.parametrize("case", CASES)
def test_setting_reads_back(case):
    cfg = compose_config(CASES[case])
    _reads_back(cfg, check(cfg)[0])


def test_a_static_loss_scale_of_zero_is_refused():
    """DeepSpeed (fp16.loss_scale 0) and megatron-core (a falsy loss_scale) both read 0 as dynamic
    scaling: a static scale of 0 would train otherwise than asked."""
    cfg = compose_config([*CASES["fp16_static"][:-1], "precision.loss_scale=0"])
    with pytest.raises(ValidationError, match=r"precision.loss_scale=0.0: a static loss scale must be positive"):
        check(cfg)
