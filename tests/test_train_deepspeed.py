"""The deepspeed backend trains the emitted DeepSpeed config: ZeRO 0-3, offload, activation
checkpointing and the 2-stage pipeline reproduce the single-process run -- loss, learning rate and
gradient norm at every step, and the final parameters gathered from the checkpoint (fp32, no
warmup, every parameter updated in the reference run) -- and ZeRO-3 learns on the real corpus.
Exported to transformers (`parakit export`), a checkpoint reproduces the loss its run computed
next, and the ZeRO-3 and pipeline checkpoints load and generate with the trained weights.
Mutation: one layer's MLP never updated in the pipeline run is caught."""

import hf_export
import pytest
from training_runs import (
    DEEPSPEED_SHORT,
    Tolerance,
    Trained,
    assert_same_parameters,
    assert_same_training,
    assert_stage_times,
    checkpoint_parameters,
    run,
    trained,
    unmoved_parameters,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_processes_left_behind")]

COMMON = [*DEEPSPEED_SHORT, "checkpoint.interval_steps=4"]
# Measured over 4 steps against the single process: losses within 9.5e-7 (one float32 step at a
# loss of 10.8: the replicas' means add up in another order), grad norms within 1.2e-7
# (relative), final parameters within 9.2e-8 RMS. The smallest defect to catch, one layer's MLP
# never updated (the pipeline case that hid inside the old 1e-4), moves the loss by 4.8e-5, the
# grad norm by 4.8e-3 and that MLP by 1.7e-3 RMS.
TOLERANCE = Tolerance(loss=4e-6, grad_norm=1e-4, parameters=1e-6)  # loss: 4 float32 steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, ZeRO-1 (ZeRO-0 reports no gradient norm); it keeps its step-1 checkpoint too."""
    return trained(
        tmp_path_factory.mktemp("reference"),
        "single",
        *COMMON,
        "cluster.gpus_per_node=1",
        "zero=1",
        "checkpoint.interval_steps=1",
        "checkpoint.keep_last=4",
    )


def test_reference_run_updates_every_parameter_at_every_step(reference):
    first = checkpoint_parameters(reference.run_dir / "checkpoints" / "step_00000001")
    assert not unmoved_parameters(first, reference.parameters)
    assert all(r["lr"] > 0 and r["grad_norm"] > 0 for r in reference.records)


VARIANTS = {
    "zero0_dp2": ["zero=0"],
    "zero1_dp2": None,  # the session's run (conftest.deepspeed_zero1_dp2)
    "zero2_dp2": ["zero=2"],
    "zero3_dp2_activation_checkpointing": ["zero=3", "recompute=full"],
    "zero2_offload_dp2": ["zero=2_offload"],
    "zero3_offload_dp2": ["zero=3_offload"],
    "pipeline_pp2": ["parallel.pp=2", "zero=1"],
    # ZeRO++ hpZ: a second copy of the parameters sharded over groups of 2 of the 4 ranks, the
    # backward's all-gathers from it
    "zero3_hpz2_dp4": ["zero=3", "comm.hpz_partition_size=2", "cluster.gpus_per_node=4"],
}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, request):
    """variant -> its run, trained once for the parity test and the export tests."""
    runs = {}

    def get(variant: str):
        if variant not in runs and VARIANTS[variant] is None:
            runs[variant] = request.getfixturevalue(f"deepspeed_{variant}")
        elif variant not in runs:
            tmp = tmp_path_factory.mktemp(variant)
            runs[variant] = trained(tmp, variant, *COMMON, "cluster.gpus_per_node=2", *VARIANTS[variant])
        return runs[variant]

    return get


@pytest.mark.parametrize("variant", VARIANTS)
def test_layout_reproduces_single_process_training(reference, layout_runs, variant):
    got = layout_runs(variant)
    assert_same_training(reference, got, TOLERANCE, grad_norm=variant != "zero0_dp2")  # ZeRO-0 reports none
    assert_stage_times(got, 2 if variant.startswith("pipeline") else 1)
    # the emitted "torch_adam" on CPU (offloaded too): no FusedAdam or CPU Adam to compile
    # and train.kernels=auto on CPU: the reference layers and loss
    assert got.result["kernels"] == {
        "attention": "transformers sdpa",
        "adam": "torch.optim.adamw.AdamW",
        "layers": "transformers eager PyTorch operations",
        "loss": "torch cross_entropy over the logits",
    }


def test_export_reproduces_the_loss_the_run_computed(tmp_path, reference):
    """The step-3 checkpoint (ZeRO-1) in transformers computes step 4's loss as the engine did
    (measured: equal; both run the same transformers model in fp32)."""
    hf = hf_export.export(reference.run_dir, tmp_path / "hf", "--step", 3)
    found = hf_export.checked(reference.run_dir, hf, 3)
    assert abs(found["loss"] - found["recorded_loss"]) <= 1e-6, found


@pytest.mark.parametrize("variant", ["zero3_dp2_activation_checkpointing", "pipeline_pp2"])
def test_export_loads_and_generates_with_the_trained_weights(tmp_path, reference, layout_runs, variant):
    """ZeRO-3 (gathered by zero_to_fp32) and the pipeline's layer files: transformers loads the
    export and generates; its weights are those DeepSpeed's own readers gather from the checkpoint
    (exactly) and those of the single-process run (within the parity tolerance)."""
    run = layout_runs(variant)
    model = hf_export.loaded(hf_export.export(run.run_dir, tmp_path / "hf"))
    assert_same_parameters(run.parameters, model.state_dict(), 0.0)
    assert_same_parameters(reference.parameters, model.state_dict(), TOLERANCE.parameters)


@pytest.mark.mutation
def test_hpz_parity_catches_a_secondary_partition_never_refreshed(tmp_path, reference):
    """hpZ's second copy of the parameters kept from the first step: the backward computes with
    stale weights from step 2 on."""
    got = trained(tmp_path, "stale", *COMMON, *VARIANTS["zero3_hpz2_dp4"], mutation="hpz_stale")
    with pytest.raises(AssertionError, match="grad norm|loss|final parameters"):
        assert_same_training(reference, got, TOLERANCE)


@pytest.mark.mutation
def test_pipeline_parity_catches_a_layer_never_updated(tmp_path, reference):
    got = trained(
        tmp_path, "frozen", *COMMON, "cluster.gpus_per_node=2", *VARIANTS["pipeline_pp2"], mutation="frozen_mlp"
    )
    with pytest.raises(AssertionError, match="grad norm|loss|final parameters"):
        assert_same_training(reference, got, TOLERANCE)


def test_zero3_trains_on_a_prepared_corpus_with_falling_validation_loss(tmp_path, prepared_corpus):
    """Your own data on the deepspeed backend: the 76,000-token corpus that `parakit data prepare`
    made (tests/conftest.py), ZeRO-3 on 2 ranks, a validation loss every 4 steps that falls
    (tests/test_own_data.py: the same on megatron, with a resume)."""
    from test_own_data import assert_validation_falls, common

    result = run(tmp_path, "own", *common(prepared_corpus), "backend=deepspeed", "zero=3", "precision=fp32")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "vocab 76,000" in result.stdout
    assert_validation_falls(Trained(result.run_dir), result.run_dir)
