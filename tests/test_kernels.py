"""train.kernels: which element-wise and loss kernels a run computes with (toolkit.plan.backends.kernels_of),
what the validator says of them, what the emitters write, what the planner prices, and the trainers'
GPU branches driven on CPU: megatron-core's fused cross-entropy against its reference one, and
Liger's kernels applied to the deepspeed backend's transformers model (a stand-in Liger module:
its kernels are Triton's, GPU only; their numerics are scripts/gpu_check.sh's to check)."""

import subprocess
import sys
import textwrap

import pytest

from toolkit.emit.megatron import megatron_sections
from toolkit.emit.megatron_args import section_flags
from toolkit.plan.backends import backend_of, kernels_of, packages_needed
from toolkit.plan.layout import resolve
from toolkit.plan.memory import loss_bytes, peak_memory
from toolkit.plan.perf import estimate_step
from toolkit.plan.validate import validate

GPU = ["cluster=1xh200", "precision=bf16"]
# the H200 run whose DeepSpeed peak was 25 GiB over megatron's (issue 45)
H200_RUN = [*GPU, "model=llama3_1b", "model.seq_length=4096", "train.micro_batch=4", "train.global_batch=32", "zero=1"]


@pytest.mark.parametrize(
    "overrides, layers, loss",
    [
        ([], False, False),  # auto on CPU: the reference kernels
        (["train.kernels=reference", *GPU], False, False),
        ([*GPU], True, True),  # auto on a GPU: fused
        ([*GPU, "precision=fp32"], True, False),  # megatron-core's fused loss returns bf16 gradients
        ([*GPU, "backend=deepspeed"], True, True),
        ([*GPU, "backend=deepspeed", "zero=3"], True, False),  # ZeRO-3 partitions the output weight
        ([*GPU, "backend=deepspeed", "parallel.pp=2", "parallel.dp=4", "cluster=8xh100"], True, False),
        ([*GPU, "backend=deepspeed", "model=gpt2_124m"], False, False),  # no Liger kernels for GPT-2
        ([*GPU, "backend=deepspeed", "model=tiny_moe"], False, False),  # nor for the mixtures of experts
    ],
)
def test_the_choice_resolves_per_backend_and_cluster(compose, overrides, layers, loss):
    resolved = kernels_of(compose(*overrides))
    assert (resolved.layers, resolved.loss) == (layers, loss), resolved


def test_fused_on_cpu_is_refused_with_the_fix(compose):
    report = validate(compose("train.kernels=fused"))
    (error,) = [e for e in report.errors if e.rule == "kernels"]
    assert "CUDA GPUs" in error.message and "train.kernels=reference" in error.fix


def test_a_part_that_stays_reference_under_fused_is_said(compose):
    report = validate(compose(*GPU, "backend=deepspeed", "zero=3", "train.kernels=fused", "checks.memory=off"))
    assert report.ok, report
    (warning,) = [w for w in report.warnings if w.rule == "kernels"]
    assert "ZeRO-3" in warning.message and "torch cross_entropy" in warning.message
    assert not [w for w in validate(compose(*GPU, "backend=deepspeed", "zero=3")).warnings if w.rule == "kernels"]


def test_liger_is_needed_where_the_deepspeed_kernels_are_fused_and_missing_it_is_an_error(compose):
    fused = compose(*GPU, "backend=deepspeed")
    assert [p.install for p in packages_needed(fused)] == ["liger-kernel==0.8.5"]
    assert packages_needed(compose(*GPU, "backend=deepspeed", "train.kernels=reference")) == []
    assert packages_needed(compose("backend=deepspeed")) == []  # CPU
    report = validate(fused, installed=lambda module: not module.startswith("liger_kernel"))
    (error,) = [e for e in report.errors if e.rule == "package"]
    assert "liger-kernel==0.8.5" in error.fix and "train.kernels=reference" in error.fix


def test_megatron_yaml_and_the_command_line_carry_the_fused_loss(compose):
    cfg = compose(*GPU)
    sections = megatron_sections(cfg, resolve(cfg))
    assert sections["model_parallel"]["cross_entropy_loss_fusion"] is True
    assert sections["model_parallel"]["cross_entropy_fusion_impl"] == "native"
    assert sections["transformer"]["bias_dropout_fusion"] is True
    flags = {flag[0]: flag[1:] for flag in section_flags(sections)}
    assert flags["--cross-entropy-fusion-impl"] == ["native"] and "--cross-entropy-loss-fusion" in flags
    reference = compose(*GPU, "train.kernels=reference")
    sections = megatron_sections(reference, resolve(reference))
    assert not sections["model_parallel"]["cross_entropy_loss_fusion"]
    assert not sections["transformer"]["bias_dropout_fusion"] and not sections["transformer"]["bias_activation_fusion"]
    assert "--cross-entropy-loss-fusion" not in {flag[0] for flag in section_flags(sections)}


def test_liger_loss_holds_its_chunks_not_the_logits():
    """ops/fused_linear_cross_entropy.py at llama3_1b's output layer, 4 x 4096 tokens: 63 chunks'
    worth of vocabulary per hidden size, so chunks of next_power_of_2(ceil(16384 / 63)) = 512 tokens."""
    tokens, vocab, hidden = 16384, 128256, 2048
    backend = backend_of_kernels("deepspeed", loss=True)
    expected = (tokens * hidden + vocab * hidden + 512 * vocab) * 2 + 4 * tokens
    assert loss_bytes(backend, tokens, vocab, hidden, 2) == expected
    # the reference loss: 16-bit logits, log-probabilities, their gradient and the logits' fp32 gradient
    reference = backend_of_kernels("deepspeed", loss=False)
    assert loss_bytes(reference, tokens, vocab, hidden, 2) == tokens * vocab * (2 + 3 * 4)


def backend_of_kernels(name: str, loss: bool):
    from toolkit.plan.backends import _with_kernels, backend_named

    return _with_kernels(backend_named(name), False, loss)


def test_the_planner_follows_the_kernels(compose):
    """On the H200 run: DeepSpeed's fused loss frees the logits (17 GiB at 128k vocabulary), its
    fused layers the eager norms' fp32 copies, and both backends' steps shorten; megatron-core's
    fused loss changes the passes, not the memory."""
    for backend in ("deepspeed", "megatron"):
        fused, reference = (
            compose(*H200_RUN, f"backend={backend}"),
            compose(*H200_RUN, f"backend={backend}", "train.kernels=reference"),
        )
        layout = resolve(fused)
        mem_fused, mem_reference = peak_memory(fused, layout), peak_memory(reference, layout)
        step_fused, step_reference = estimate_step(fused, layout), estimate_step(reference, layout)
        assert step_fused.step_time < step_reference.step_time, backend
        if backend == "deepspeed":
            assert mem_reference.logits - mem_fused.logits > 15 * 2**30
            assert mem_fused.activations < mem_reference.activations  # no eager norm copies
        else:
            assert mem_fused.logits == mem_reference.logits
            assert mem_fused.activations == mem_reference.activations
    # megatron's fused loss: 5 fp32 passes beside the upcast and downcast (9 unfused)
    assert backend_of(compose(*GPU)).loss_logit_passes == 5
    assert backend_of(compose(*GPU, "train.kernels=reference")).loss_logit_passes == 9


SCRIPT = textwrap.dedent("""
    import sys, types, torch
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    from toolkit.compat import import_shims
    import_shims()
    import torch._dynamo
    torch._dynamo.config.disable = True  # megatron-core's torch.compile'd fusions, run as written
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    # megatron-core's fused cross-entropy against its reference one: bf16 logits [s, b, v]
    group = torch.distributed.group.WORLD
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 2, 1000, generator=gen) * 3).to(torch.bfloat16)
    target = torch.randint(0, 1000, (64, 2), generator=gen)
    weights = torch.rand(64, 2, generator=gen)
    grads, losses = [], []
    for fn in (lambda x: fused_vocab_parallel_cross_entropy(x, target, group),
               lambda x: vocab_parallel_cross_entropy(x, target, tp_group=group)):
        x = logits.clone().requires_grad_()
        loss = fn(x)
        (loss * weights).sum().backward()
        losses.append(loss.float()); grads.append(x.grad.float())
    assert torch.equal(losses[0], losses[1]), (losses[0] - losses[1]).abs().max()
    scale = grads[1].abs().max()
    # both round the fp32 gradient to bf16 once: within one bf16 ulp (2**-8 relative) of the largest
    diff = (grads[0] - grads[1]).abs().max() / scale
    assert diff <= 2 ** -8, diff
    print("megatron fused cross-entropy ok", float(diff))

    # deepspeed: Liger's apply function gets the built model and the resolved kernels
    calls = []
    monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": lambda **kw: calls.append(kw)}
    for name in ("liger_kernel", "liger_kernel.transformers"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["liger_kernel.transformers.monkey_patch"] = monkey_patch
    from toolkit.config.store import compose_config
    from toolkit.train import deepspeed_engine
    cfg = compose_config(["model=tiny", "backend=deepspeed", "cluster=1xh200", "precision=bf16", "zero=1"])
    model = deepspeed_engine.build_hf_model(cfg, {}, None)
    (call,) = calls
    assert call.pop("model") is model
    fused = dict(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    assert call == dict(fused, cross_entropy=False), call
    calls.clear()
    reference = compose_config(["model=tiny", "backend=deepspeed", "cluster=1xh200", "train.kernels=reference"])
    deepspeed_engine.build_hf_model(reference, {}, None)
    assert calls == [], calls

    # the labels the fused loss takes: masked tokens ignored, the mean over the rest = parakit's loss
    logits = torch.randn(2, 16, 50, generator=gen)
    labels = torch.randint(0, 50, (2, 16), generator=gen)
    mask = (torch.rand(2, 16, generator=gen) > 0.3).float()
    ignored = deepspeed_engine.ignored_labels(labels, mask)
    liger_mean = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), ignored.reshape(-1), ignore_index=-100)
    assert torch.allclose(liger_mean, deepspeed_engine.token_loss(logits, labels, mask), rtol=1e-6)
    print("deepspeed liger ok")
""")


def test_gpu_branches_on_cpu():
    got = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr[-3000:]
    assert "megatron fused cross-entropy ok" in got.stdout and "deepspeed liger ok" in got.stdout


def test_gpu_checks_kernels_run_takes_the_largest_micro_batch_that_fits_the_card():
    """The H200's DeepSpeed run with the reference kernels (micro-batch 4) reserved 91 GiB: on an
    80 GB H100 gpu_check's kernels step runs micro-batch 2."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    for cluster, micro in (("1xh200", 4), ("8xh100", 2)):
        overrides = [o if not o.startswith("cluster=") else f"cluster={cluster}" for o in gpu_check.GPU[0]]
        assert gpu_check.kernels_micro_batch([*overrides, *gpu_check.KERNELS_GPU[0]]) == micro, cluster
