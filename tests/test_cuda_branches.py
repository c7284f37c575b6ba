"""What parakit builds where CUDA is present, checked on this CPU machine: the branches that run
only on GPUs are driven here with torch.cuda patched to report a device (tests/dist/cuda_branches.py,
one process for all the megatron-core facts), or read from what is emitted for a GPU cluster."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "dist" / "cuda_branches.py"


@pytest.fixture(scope="module")
def facts():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_torch_adam_resume_fixes_are_installed_on_a_gpu_without_te_or_apex(facts):
    """megatron-core runs torch's AdamW there as on CPU: without the fixes a resume raises
    KeyError 'step' or shares one step tensor between all parameters."""
    assert not facts["cpu_layer_entered"]
    assert facts["torch_adam_resume_fixes"]


def test_a_gpu_without_te_builds_the_local_spec_with_sdpa_sequence_parallel_norms_on_the_device(facts):
    assert facts["core_attention"] == "SdpaAttention"
    assert facts["norms"] == ["RMSNorm"] and facts["norm_weights_marked"]
    assert facts["chunks_moved_to_gpu"] == 1  # Megatron-LM's get_model: torch norms are built on the host


def test_a_gpu_builds_moe_layers_with_the_local_spec_or_asks_te_for_them(facts):
    """Without TE: megatron-core's MoELayer with sequential experts, SDPA and torch norms as the dense
    layers. With TE: one TE spec per kind of layer (the MoE one with its experts, grouped GEMM and
    the QK norm), laid out as moe_layer_freq says (layer 1 dense), and TE's norm to end the block."""
    assert facts["moe_mlp"] == ["MoELayer", "SequentialMLP"] and facts["moe_core_attention"] == "SdpaAttention"
    assert facts["moe_norms"] == ["RMSNorm"]
    assert facts["te_specs_asked"] == [
        {"num_experts": None, "moe_grouped_gemm": False, "qk_layernorm": True},
        {"num_experts": 4, "moe_grouped_gemm": True, "qk_layernorm": True},
    ]
    assert facts["te_layers"] == ["moe", "dense", "moe", "moe"] and facts["te_final_norm"] == "TENorm"


def test_flash_attention_lets_transformer_engine_choose_its_fused_kernel(facts):
    """train.attention_backend=flash is megatron-core's `auto` on GPUs: TE keeps cuDNN's fused
    attention and FlashAttention both (megatron-core's `flash` forces NVTE_FUSED_ATTN=0)."""
    assert facts["attention_backend"] == "auto"
    assert facts["nvte"] == {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "1"}


def test_every_rank_runs_with_one_device_queue_from_launch_sh_and_from_parakit_train(compose, monkeypatch, tmp_path):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (megatron-core's TP/SP communication ordered with compute) and
    NCCL's async error handling: in launch.sh, in torchrun's environment, and set in this process
    when one rank trains here; megatron-core's warning about it is silenced on CPU only."""
    from toolkit.emit.launch import launch_script
    from toolkit.plan.layout import resolve
    from toolkit.train import launch, torchrun, trainer

    gpu = compose("cluster=1xh200", "model=tiny")
    expected = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    for name in expected:  # unset here, and restored after the test (train_here sets them in os.environ)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert expected.items() <= torchrun.torchrun_env(gpu).items()
    script = launch_script(gpu, resolve(gpu))
    assert all(f"export {k}={v}" in script for k, v in expected.items())
    seen = {}
    monkeypatch.setattr(trainer, "quiet_upstream_notices", lambda: None)
    monkeypatch.setattr(trainer, "run_to_exit_code", lambda cfg, run_dir: seen.update(launch.os.environ) or 0)
    assert launch.train_here(gpu, resolve(gpu), tmp_path) == 0
    assert seen["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    monkeypatch.undo()  # the trainer's own quiet_upstream_notices again
    from toolkit.train.trainer import quiet_upstream_notices

    advice = "Using sequence parallelism requires setting the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1"
    for on_gpu, printed in ((True, True), (False, False)):  # silenced on CPU only, where it is noise
        monkeypatch.setattr(torch.cuda, "is_available", lambda on_gpu=on_gpu: on_gpu)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_upstream_notices()
            warnings.warn(advice, UserWarning)
        assert any(advice in str(w.message) for w in caught) == printed, f"on_gpu={on_gpu}"


def test_on_a_gpu_allocated_memory_is_compared_with_tensors_and_reserved_with_the_allocators_share(
    compose, monkeypatch, tmp_path
):
    """max_memory_allocated against the planner's tensors (no allocator allowance, no CUDA
    context), max_memory_reserved against tensors plus fragmentation: both recorded per step."""
    import torch

    from toolkit.plan.layout import resolve
    from toolkit.plan.memory import CUDA_RUNTIME_BYTES, GIB, peak_memory
    from toolkit.report.sweep import _predicted
    from toolkit.train.metrics import Metrics

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 4 * GIB)
    cfg = compose("cluster=1xh200", "model=llama3_1b", "train.global_batch=16", "train.micro_batch=4")
    layout = resolve(cfg)
    planned = peak_memory(cfg, layout)
    metrics = Metrics(cfg, layout, tmp_path, enabled=False)
    metrics.step(1, 10.0, 1e-4, 1.0, False)
    record = metrics.history[-1]
    assert record["memory_gib"] == 3 and record["memory_reserved_gib"] == 4
    assert record["predicted_memory_gib"] == pytest.approx(planned.tensors / GIB)
    assert record["predicted_reserved_gib"] == pytest.approx(planned.reserved / GIB)
    assert planned.tensors < planned.reserved < planned.total
    assert planned.total - planned.reserved == CUDA_RUNTIME_BYTES
    assert planned.total - planned.tensors == pytest.approx(planned.allowance)
    assert _predicted(cfg, layout)["predicted_memory_gib"] == pytest.approx(planned.tensors / GIB)  # sweeps too


def test_deepspeed_on_gpus_steps_torchs_fused_adamw_with_no_build(compose):
    """DeepSpeed's FusedAdam is JIT-compiled with nvcc at the first run: the emitted JSON asks for
    torch's AdamW as its fused CUDA kernel instead (DeepSpeed passes the remaining parameters to
    torch.optim.AdamW: engine.get_optimizer_configuration), except for an optimizer offloaded to
    the host, which keeps DeepSpeed's CPU Adam."""
    import torch

    from toolkit.emit.deepspeed import deepspeed_config
    from toolkit.plan.layout import resolve

    gpu = compose("cluster=1xh200", "model=tiny", "backend=deepspeed", "zero=1")
    params = dict(deepspeed_config(gpu, resolve(gpu))["optimizer"]["params"])
    assert params.pop("torch_adam") is True and params["fused"] is True
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], **params, foreach=None)
    assert adamw.defaults["fused"] is True
    offloaded = compose("cluster=1xh200", "model=tiny", "backend=deepspeed", "zero=2_offload")
    assert deepspeed_config(offloaded, resolve(offloaded))["optimizer"]["params"]["torch_adam"] is False
    cpu = compose("model=tiny", "backend=deepspeed")
    assert "fused" not in deepspeed_config(cpu, resolve(cpu))["optimizer"]["params"]


def _fake_transformer_engine(monkeypatch, calls: list, quantization_modes: bool):
    """transformer_engine.pytorch.module.base with initialize_ub / destroy_ub recording their calls,
    in TE's signature since 2.7 (quantization_modes) or before it (use_fp8)."""
    import enum
    import sys
    import types

    base = types.ModuleType("transformer_engine.pytorch.module.base")
    if quantization_modes:
        base.UserBufferQuantizationMode = enum.Enum("UserBufferQuantizationMode", "NONE FP8")

        def initialize_ub(shape, tp_size, quantization_modes=None, ub_cfgs=None, bootstrap_backend=None):
            calls.append(dict(shape=shape, tp_size=tp_size, modes=quantization_modes, bootstrap=bootstrap_backend))

    else:

        def initialize_ub(shape, tp_size, use_fp8=False, ub_cfgs=None, bootstrap_backend=None):
            calls.append(dict(shape=shape, tp_size=tp_size, use_fp8=use_fp8, bootstrap=bootstrap_backend))

    base.initialize_ub, base.destroy_ub = initialize_ub, lambda: calls.append("destroyed")
    module = types.ModuleType("transformer_engine.pytorch.module")
    module.base = base
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.module = module
    te = types.ModuleType("transformer_engine")
    te.pytorch = pytorch
    for name, value in (("", te), (".pytorch", pytorch), (".pytorch.module", module), (".pytorch.module.base", base)):
        monkeypatch.setitem(sys.modules, "transformer_engine" + name, value)
    return base


OVERLAP = ["cluster=8xh100", "model=llama3_8b", "parallel.tp=4", "parallel.cp=2", "parallel.sequence_parallel=true"]


@pytest.mark.parametrize("quantization_modes", [True, False], ids=["te>=2.7", "te<2.7"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_tp_comm_overlap_sets_up_te_userbuffers_for_one_micro_batch_of_this_cp_rank(
    compose, monkeypatch, quantization_modes, dtype
):
    """As Megatron-LM's _initialize_tp_communicators: a (seq x micro batch / cp, hidden) buffer over
    the tensor-parallel ranks, NCCL bootstrap, fp8 buffers for fp8 runs, in either TE signature."""
    from toolkit.emit.megatron import megatron_sections
    from toolkit.plan.layout import resolve
    from toolkit.train.megatron_configs import build_megatron_configs
    from toolkit.train.megatron_model import destroy_tp_comm_overlap, initialize_tp_comm_overlap

    cfg = compose(*OVERLAP, "parallel.tp_comm_overlap=true", f"precision={dtype}", "train.micro_batch=2")
    layout = resolve(cfg)
    config, _, _ = build_megatron_configs(megatron_sections(cfg, layout))
    calls = []
    base = _fake_transformer_engine(monkeypatch, calls, quantization_modes)  # after megatron-core looked for TE
    initialize_tp_comm_overlap(config, layout.seq_length, layout.micro_batch)
    destroy_tp_comm_overlap()
    expected = dict(shape=[8192 * 2 // 2, 4096], tp_size=4, bootstrap="nccl")
    if quantization_modes:
        modes = base.UserBufferQuantizationMode
        expected["modes"] = [modes.FP8 if dtype == "fp8" else modes.NONE]
    else:
        expected["use_fp8"] = dtype == "fp8"
    assert calls == [expected, "destroyed"]


@pytest.mark.parametrize("overlap", [True, False])
def test_the_megatron_trainer_sets_up_the_userbuffers_before_it_builds_the_model(compose, monkeypatch, overlap):
    """TE's layers look their userbuffers up when they run: MegatronSteps makes them first, and only
    for parallel.tp_comm_overlap (the distributed start-up and the model are spied on here)."""
    from toolkit.compat import import_shims
    from toolkit.plan.layout import resolve
    from toolkit.train import megatron_backend, megatron_model

    import_shims()  # megatron-core without triton
    from megatron.core import parallel_state

    events = []

    class Built(Exception):
        pass

    def build(*_args, **_kwargs):
        events.append("build")
        raise Built

    monkeypatch.setattr(megatron_backend, "prepare_megatron", lambda: None)  # no CPU layer in this process
    monkeypatch.setattr(megatron_backend, "_init_distributed", lambda layout: None)
    monkeypatch.setattr(megatron_backend, "_seed", lambda seed: None)
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", lambda **kwargs: None)
    monkeypatch.setattr(megatron_model, "initialize_tp_comm_overlap", lambda *args: events.append(("ub", args[1:])))
    monkeypatch.setattr(megatron_model, "build_model_chunks", build)
    cfg = compose(*OVERLAP, f"parallel.tp_comm_overlap={overlap}", "train.micro_batch=2")
    layout = resolve(cfg)
    with pytest.raises(Built):
        megatron_backend.MegatronSteps(cfg, layout)
    assert events == ([("ub", (layout.seq_length, 2))] if overlap else []) + ["build"]
