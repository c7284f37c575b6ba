"""The two backends build the same model and train it the same way: from the same weights
(megatron-core's initial weights, converted to transformers by toolkit.interop.megatron_to_hf)
their logits agree, and 10 training steps give the same loss, learning rate and gradient norm
at every step. Mutations: a converter or config defect -- two query heads swapped, SwiGLU's gate
and up projections swapped, the final norm dropped, another RoPE base -- is caught by the logits
(each moved the first loss by only 8e-6 to 4e-5, which is why the first loss alone proved little);
weight decay on the norms (what megatron-core leaves out) is caught by the curves."""

import json
import subprocess
from pathlib import Path

import pytest
from training_runs import Tolerance, python, trained

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_processes_left_behind")]

TESTS = Path(__file__).parent
BASE = [
    "model=tiny",
    "model.vocab_size=50304",
    "data=synthetic",
    "precision=fp32",
    "train.steps=10",
    "train.global_batch=4",
    "train.micro_batch=2",
    "cluster.gpus_per_node=1",
    "zero=1",
    "optim.lr=1e-3",
    "optim.warmup_steps=0",
]
# Measured: the logits agree within 3e-7 (fp32; the attention and norm implementations round
# differently); the smallest converter defect above (RoPE base) moves them by 2.6e-3.
LOGITS_TOLERANCE = 1e-5
# Measured over 10 steps: the losses are equal, the grad norms within 1.4e-4 (relative; attention
# gradients near a uniform softmax cancel, and the runs drift apart by Adam's eps amplification).
# Weight decay on the norms moves the loss by 1.9e-6 at step 2 and 3.8e-6 at step 3, the grad
# norm by 1.6e-4 at step 2 and 3.4e-4 at step 3.
CURVES_TOLERANCE = Tolerance(loss=1e-6, grad_norm=3e-4, parameters=float("nan"))  # no parameters: other layouts


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """megatron from its initial weights; the same weights converted; deepspeed from those."""
    tmp = tmp_path_factory.mktemp("cross")
    init, hf = tmp / "init", tmp / "hf"
    megatron = trained(tmp, "megatron", *BASE, f"train.save_init_checkpoint={init}")
    convert = subprocess.run(
        [
            python(),
            "-m",
            "toolkit.interop.megatron_to_hf",
            "--config",
            str(megatron.run_dir / "config.yaml"),
            "--checkpoint",
            str(init),
            "--out",
            str(hf),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert convert.returncode == 0, convert.stderr[-3000:]
    logits = subprocess.run(
        [
            python(),
            str(TESTS / "dist" / "cross_backend_logits.py"),
            "29543",
            str(megatron.run_dir),
            str(init),
            str(hf),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert logits.returncode == 0, logits.stderr[-3000:]
    deepspeed = trained(tmp, "deepspeed", *BASE, "backend=deepspeed", f"model.hf_path={hf}")
    return {
        "megatron": megatron,
        "deepspeed": deepspeed,
        "hf": hf,
        "logits": json.loads(logits.stdout.strip().splitlines()[-1]),
    }


def assert_same_logits(difference: float) -> None:
    assert difference <= LOGITS_TOLERANCE, f"logits differ by {difference}"


def test_megatron_and_transformers_models_compute_the_same_logits(runs):
    assert_same_logits(runs["logits"]["faithful"])


def assert_same_curve(megatron: list, deepspeed: list, steps: int = 10) -> None:
    """deepspeed's first `steps` steps are megatron's."""
    assert [r["step"] for r in deepspeed] == [r["step"] for r in megatron[:steps]] == list(range(1, steps + 1))
    for m, d in zip(megatron, deepspeed):
        assert d["lr"] == m["lr"], (m["step"], "lr", d["lr"], m["lr"])
        assert d["loss"] == pytest.approx(m["loss"], abs=CURVES_TOLERANCE.loss), (m["step"], "loss")
        assert d["grad_norm"] == pytest.approx(m["grad_norm"], rel=CURVES_TOLERANCE.grad_norm), (m["step"], "grad norm")


def test_both_backends_train_the_same_curve(runs):
    assert_same_curve(runs["megatron"].records, runs["deepspeed"].records)


@pytest.mark.mutation
def test_curves_catch_weight_decay_on_the_norms(tmp_path, runs):
    """The decay shows from step 2 on: the mutant stops after step 3."""
    mutant = [*BASE, "backend=deepspeed", f"model.hf_path={runs['hf']}", "train.stop_after_steps=3"]
    decayed = trained(tmp_path, "decayed", *mutant, mutation="norms_decayed")
    with pytest.raises(AssertionError, match="loss|grad norm"):
        assert_same_curve(runs["megatron"].records, decayed.records, steps=3)


@pytest.mark.mutation
@pytest.mark.parametrize("defect", ["swapped_query_heads", "swapped_gate_up", "no_final_norm", "rope_base_500000"])
def test_logits_catch_a_converter_defect(runs, defect):
    with pytest.raises(AssertionError):
        assert_same_logits(runs["logits"][defect])
