"""Mixture-of-experts training on the megatron backend (CPU, gloo, dropless alltoall dispatch,
sequential experts): expert parallel alone, with tensor parallel (etp following tp, and etp=1) and
with pipeline parallel reproduces the single-process run -- loss, learning rate, gradient norm
and the routers' load-balancing loss at every step, and the final parameters -- from the seed
alone (every expert drawn by its global number, at any ep). A stopped expert-parallel run
resumes bit for bit, and the single process's checkpoint resumes expert-parallel. Full and
selective recompute run with tensor x expert parallel. Mutations: tokens handed to the wrong
expert, and expert gradients left unreduced over their expert-data-parallel ranks, are caught."""

import shutil

import pytest
from training_runs import (
    Tolerance,
    Trained,
    assert_same_steps,
    assert_same_training,
    dist_checkpoint_parameters,
    run,
    trained,
)

from toolkit.train import checkpoint as ckpt

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_processes_left_behind")]

# fp32, synthetic tokens (2048: a small output layer), the distributed optimizer; saves at steps 2
# and 4 (the resume's and the parameters').
COMMON = [
    "model=tiny_moe",
    "model.vocab_size=2048",
    "model.moe.z_loss_coeff=1e-3",
    "data=synthetic",
    "precision=fp32",
    "zero=1",
    "train.steps=4",
    "train.global_batch=8",
    "train.micro_batch=1",
    "optim.lr=1e-3",
    "optim.warmup_steps=0",
    "checkpoint.interval_steps=2",
]
SP = "parallel.sequence_parallel=true"
LAYOUTS = {
    # 4 data-parallel ranks, 2 experts each: every expert on 2 ranks (expert-dp 2)
    "dp4_ep2": ["cluster.gpus_per_node=4", "parallel.ep=2"],
    # each expert split over the 2 tp ranks (etp follows tp): one 4-rank expert mesh; recomputed
    "tp2_ep2": ["cluster.gpus_per_node=4", "parallel.tp=2", SP, "parallel.ep=2", "recompute=full"],
    "tp2_ep2_etp1": [
        "cluster.gpus_per_node=4",
        "parallel.tp=2",
        SP,
        "parallel.ep=2",
        "parallel.etp=1",
        "recompute=selective",
    ],
    "pp2_ep2": ["cluster.gpus_per_node=4", "parallel.pp=2", "parallel.ep=2"],
}
# Measured over 4 steps against the single process: losses within 9.5e-7, grad norms within
# 1.6e-6 (relative), the load-balancing loss within 2.4e-7. The smallest defects to catch, at step
# 1: a token handed to its neighbour's expert moves the loss by 6e-4 and the grad norm by 0.1%;
# one replica's expert gradients instead of their average move the grad norm by 0.9%.
TOLERANCE = Tolerance(loss=4e-6, grad_norm=1e-4, parameters=1e-6)
EXACT = Tolerance(loss=0.0, grad_norm=0.0, parameters=0.0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run (ep1); it also saves its initial weights (for the mutation tests)."""
    tmp = tmp_path_factory.mktemp("moe_reference")
    init = tmp / "init"
    result = run(tmp, "single", *COMMON, "cluster.gpus_per_node=1", f"train.save_init_checkpoint={init}")
    assert result.returncode == 0, result.stderr[-3000:]
    single = Trained(result.run_dir)
    single.stdout = result.stdout
    return single, init


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Every layout from the seed alone, as the reference."""
    tmp = tmp_path_factory.mktemp("moe_layouts")
    return {name: trained(tmp, name, *COMMON, *o) for name, o in LAYOUTS.items()}


def _aux(run: Trained) -> list[float]:
    return [r["moe_aux_loss"] for r in run.records]


def test_the_routers_losses_are_logged_every_step(reference):
    """metrics.jsonl and TensorBoard carry the load-balancing and z-losses; near 1 for a router that
    spreads evenly (Switch Transformer's loss, eq. 4: experts x sum of load x probability)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = reference
    assert all(0.9 < r["moe_aux_loss"] < 2.0 and r["moe_z_loss"] > 0 for r in run.records), run.records
    events = EventAccumulator(str(run.run_dir / "tensorboard"))
    events.Reload()
    assert {"train/moe_aux_loss", "train/moe_z_loss"} <= set(events.Tags()["scalars"])
    last = [line for line in run.stdout.splitlines() if line.startswith("step ")][-1]
    assert f"| aux loss {run.records[-1]['moe_aux_loss']:.4g} | z loss " in last, last


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_layout_reproduces_single_process_training(reference, layouts, layout):
    run, _ = reference
    got = layouts[layout]
    assert_same_training(run, got, TOLERANCE)
    assert max(abs(a - b) for a, b in zip(_aux(run), _aux(got))) <= 1e-5, (_aux(run), _aux(got))


def test_experts_start_distinct_on_every_expert_parallel_rank(tmp_path):
    """A run from scratch at ep2 (CPU initialisation): no expert starts as a copy of another, in
    its layer or on the other rank (each expert drawn from a stream of its own, named by its layer
    and global number); measured 0.03-0.04 apart at most, against 0 for a copy."""
    init = tmp_path / "init"
    result = run(
        tmp_path,
        "scratch",
        *COMMON,
        "cluster.gpus_per_node=2",
        "parallel.ep=2",
        "train.steps=1",
        "checkpoint.interval_steps=null",
        f"train.save_init_checkpoint={init}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    weights = dist_checkpoint_parameters(init)
    experts = [weights[f"decoder.layers.{i}.mlp.experts.experts.linear_fc2.weight"] for i in range(4)]
    everyone = [w[e] for w in experts for e in range(4)]  # 4 layers x 4 experts
    gaps = [float((a - b).abs().max()) for i, a in enumerate(everyone) for b in everyone[i + 1 :]]
    assert min(gaps) > 1e-3, min(gaps)


def test_a_stopped_expert_parallel_run_resumes_exactly(tmp_path, layouts):
    """The tp2 x ep2 run again from its step-2 checkpoint: steps 3-4 and the final parameters bit for bit."""
    shutil.copytree(layouts["tp2_ep2"].run_dir, tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.rmtree(checkpoints / "step_00000004")
    (checkpoints / ckpt.LATEST).write_text("step_00000002\n")
    result = run(tmp_path, "run", *COMMON, *LAYOUTS["tp2_ep2"])
    assert result.returncode == 0, result.stderr[-3000:]
    again = Trained(result.run_dir)
    assert again.result["resumed_step"] == 2
    assert_same_training(layouts["tp2_ep2"], again, EXACT)


def test_a_single_process_checkpoint_resumes_expert_parallel(tmp_path, reference):
    """The ep1 run's step-2 checkpoint (model and distributed optimizer) resumed as dp4 x ep2:
    dist_checkpointing reshards the experts and their optimizer states; steps 3-4 and the final
    parameters as in the single process."""
    single, _ = reference
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(single.checkpoints / "step_00000002", checkpoints / "step_00000002")
    (checkpoints / ckpt.LATEST).write_text("step_00000002\n")
    result = run(tmp_path, "moved", *COMMON, *LAYOUTS["dp4_ep2"], f"checkpoint.dir={checkpoints}")
    assert result.returncode == 0, result.stderr[-3000:]
    moved = Trained(result.run_dir)
    assert moved.result["resumed_step"] == 2
    assert_same_training(single.after(2), moved, TOLERANCE)


@pytest.mark.mutation
@pytest.mark.parametrize(
    "layout, mutation", [("tp2_ep2", "moe_tokens_misrouted"), ("dp4_ep2", "expert_grads_unreduced")]
)
def test_parity_catches_a_broken_expert_parallel(tmp_path, reference, layout, mutation):
    run_, init = reference
    stop = ["train.stop_after_steps=1", "checkpoint.interval_steps=null"]  # the first step tells
    got = trained(
        tmp_path, mutation, *COMMON, *LAYOUTS[layout], *stop, f"train.init_checkpoint={init}", mutation=mutation
    )
    with pytest.raises(AssertionError, match="grad norm|loss"):
        assert_same_steps(run_.through(1), got, TOLERANCE)
