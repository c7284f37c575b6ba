"""The megatron backend trains the layout it was given: every parallel layout reproduces the
single-process loss curve (fp32, dropout off, identical initial weights loaded resharded from one
dist checkpoint), recompute changes no loss, gradient accumulation equals the larger batch, bf16
and the README demo train on the real corpus, and a wrong layout never starts a process."""
import subprocess
import sys

import pytest

from training_runs import train

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_processes_left_behind")]

# fp32, synthetic tokens, Adam via the distributed optimizer. The vocabulary is pre-padded to a
# multiple of 128 x 4 so that every tp <= 4 pads it identically (Megatron pads to 128 x tp, and
# padded rows would otherwise differ between layouts).
COMMON = ["model=tiny", "model.vocab_size=50688", "data=synthetic", "precision=fp32", "zero=1", "train.steps=4",
          "train.global_batch=8", "train.micro_batch=1", "optim.lr=1e-3", "optim.warmup_steps=1"]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run; it also saves the initial weights every layout starts from."""
    tmp = tmp_path_factory.mktemp("reference")
    init = tmp / "init"
    losses = train(tmp, "single", *COMMON, "cluster.gpus_per_node=1", f"train.save_init_checkpoint={init}")
    return losses, init


LAYOUTS = {
    "tp2": ["cluster.gpus_per_node=2", "parallel.tp=2"],
    "pp2": ["cluster.gpus_per_node=2", "parallel.pp=2"],
    "tp2_pp2_vpp2": ["cluster.gpus_per_node=4", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2"],
    "pp4_vpp2": ["cluster.gpus_per_node=4", "parallel.pp=4", "parallel.vpp=2"],
    "dp2_distributed_optimizer": ["cluster.gpus_per_node=2", "zero=1"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_reproduces_single_process_losses(tmp_path, reference, layout):
    losses, init = reference
    got = train(tmp_path, layout, *COMMON, *LAYOUTS[layout], f"train.init_checkpoint={init}")
    assert got == pytest.approx(losses, abs=TOLERANCE)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_changes_no_loss(tmp_path, reference, recompute):
    losses, init = reference
    got = train(tmp_path, recompute, *COMMON, "cluster.gpus_per_node=1", f"recompute={recompute}", f"train.init_checkpoint={init}")
    assert got == pytest.approx(losses, abs=TOLERANCE)


def test_gradient_accumulation_equals_one_larger_batch(tmp_path, reference):
    losses, init = reference  # 8 micro-batches of 1
    got = train(tmp_path, "one_batch", *COMMON, "cluster.gpus_per_node=1", "train.micro_batch=8", f"train.init_checkpoint={init}")
    assert got == pytest.approx(losses, abs=TOLERANCE)


def test_bf16_trains_on_the_corpus(tmp_path):
    losses = train(tmp_path, "bf16", "model=tiny", "data=corpus", "precision=bf16", "cluster.gpus_per_node=1",
                   "train.steps=12", "train.global_batch=8", "train.micro_batch=4", "optim.lr=2e-3", "optim.warmup_steps=2")
    assert losses[-1] < losses[0] - 0.3, losses


def test_readme_demo_trains_tp2_pp2_vpp2_on_the_corpus(tmp_path):
    losses = train(tmp_path, "demo", "recipe=tiny_cpu_demo", "train.steps=12")
    assert losses[-1] < losses[0] - 0.3, losses


def test_wrong_layout_is_rejected_before_any_process_starts(tmp_path):
    result = subprocess.run([sys.executable, "-m", "toolkit.cli", "train", "recipe=tiny_cpu_demo", "parallel.tp=3",
                             f"hydra.run.dir={tmp_path / 'bad'}"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "[world_size]" in result.stderr and "starting" not in result.stdout
    assert not (tmp_path / "bad" / "config.yaml").exists()
