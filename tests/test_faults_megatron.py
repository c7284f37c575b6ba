"""Long runs that finish (megatron backend, CPU): exact resume with the random state (dropout on),
resume into another layout, restart after a killed rank, corrupt and half-written checkpoints, a
stalled rank, NaN losses before the backward pass, asynchronous saves, and the save interval by
the planner's rule (the schedule itself: tests/test_save_schedule.py). Which checkpoint a run
resumed from is read from its result.json. Mutations: a resume that drops the scheduler's state or
the random state, and one that gives up at a corrupt checkpoint and starts from scratch, are
caught."""

import json
import os
import re
import shutil
import subprocess
import time

import pytest
import training_runs
from slurm_cluster import Following, job_state, kill_node, wait_for_step
from training_runs import (
    AUTO_INTERVAL,
    Tolerance,
    Trained,
    assert_same_steps,
    assert_same_training,
    check_planned_interval,
    losses,
    records,
)

from toolkit.config.store import load_run_config
from toolkit.train import checkpoint as ckpt

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_processes_left_behind")]

COMMON = [
    "model=tiny",
    "model.vocab_size=2048",  # synthetic tokens: a small vocabulary keeps the logits cheap
    "data=synthetic",
    "precision=fp32",
    "zero=1",
    "train.steps=6",
    "train.global_batch=8",
    "train.micro_batch=1",
    "optim.lr=1e-3",
    "optim.warmup_steps=0",
    "checkpoint.interval_steps=2",
    "train.fault.watchdog_timeout_s=120",
]  # a rank that hangs ends the job instead of the test
TP2_PP2_VPP2 = ["cluster.gpus_per_node=4", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2"]
PP2 = ["cluster.gpus_per_node=2", "parallel.pp=2"]
# Six steps with dropout: a resume that restores the weights but not the random state, the data
# position or the schedule shows in the steps after it.
LONG_WITH_DROPOUT = [*TP2_PP2_VPP2, "model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
STOP_AT_3 = "train.stop_after_steps=3"
EXACT = Tolerance(loss=0.0, grad_norm=0.0, parameters=0.0)  # a resume at the same layout is bit for bit
ANOTHER_LAYOUT = Tolerance(loss=4e-6, grad_norm=1e-4, parameters=1e-6)  # as the layout parity tests


def run(tmp_path, name, *overrides, timeout=600, mutation=None):
    return training_runs.run(tmp_path, name, *COMMON, *overrides, timeout=timeout, mutation=mutation)


def resumed(tmp_path, stopped_dir, *overrides, mutation=None) -> Trained:
    """Start a stopped run again (a copy of its directory, so that each test resumes the same one)."""
    shutil.copytree(stopped_dir, tmp_path / "run")
    result = run(tmp_path, "run", *overrides, mutation=mutation)
    assert result.returncode == 0, result.stderr[-3000:]
    return Trained(result.run_dir)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    return {
        "long": training_runs.Trained(run(tmp, "long", *LONG_WITH_DROPOUT).run_dir),
        "pp2": training_runs.Trained(run(tmp, "pp2", *PP2).run_dir),
    }


@pytest.fixture(scope="module")
def killed_at_step_3(tmp_path_factory):
    """tp2 pp2 vpp2 with dropout: rank 3 dies at the start of step 3 of 6 (the last checkpoint: step 2)."""
    stopped = run(
        tmp_path_factory.mktemp("killed"),
        "run",
        *LONG_WITH_DROPOUT,
        "train.fault.kill_rank=3",
        "train.fault.kill_at_step=3",
    )
    assert stopped.returncode != 0 and not (stopped.run_dir / "result.json").exists()
    return stopped.run_dir


def test_stopped_run_resumes_exactly_with_its_random_state(tmp_path, uninterrupted, killed_at_step_3):
    again = resumed(tmp_path, killed_at_step_3, *LONG_WITH_DROPOUT)
    assert again.result["resumed_from"].endswith("step_00000002") and again.result["resumed_step"] == 2
    assert_same_training(uninterrupted["long"], again, EXACT)  # steps 1-2 from before the kill, 3-6 resumed


# The resumed mutants stop after step 3 (the first resumed step, where both defects show; the
# unmutated resume above matches through step 6).
@pytest.mark.mutation
def test_resume_catches_a_dropped_scheduler_state(tmp_path, uninterrupted, killed_at_step_3):
    again = resumed(tmp_path, killed_at_step_3, *LONG_WITH_DROPOUT, STOP_AT_3, mutation="scheduler_state_dropped")
    with pytest.raises(AssertionError, match="lr"):
        assert_same_steps(uninterrupted["long"].through(3), again, EXACT)


@pytest.mark.mutation
def test_resume_catches_a_random_state_not_restored(tmp_path, uninterrupted, killed_at_step_3):
    again = resumed(tmp_path, killed_at_step_3, *LONG_WITH_DROPOUT, STOP_AT_3, mutation="random_state_not_restored")
    with pytest.raises(AssertionError, match="loss"):  # other dropout masks from step 3 on
        assert_same_steps(uninterrupted["long"].through(3), again, EXACT)


def test_resume_into_another_layout(tmp_path, uninterrupted):
    """The pp2 run's step-2 checkpoint, resumed as tp2 pp2 vpp2 (dist_checkpointing reshards
    model and distributed optimizer): steps 3-6 and the final parameters as in the pp2 run."""
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(uninterrupted["pp2"].checkpoints / "step_00000002", checkpoints / "step_00000002")
    (checkpoints / ckpt.LATEST).write_text("step_00000002\n")
    moved = run(tmp_path, "moved", *TP2_PP2_VPP2, f"checkpoint.dir={checkpoints}")
    assert moved.returncode == 0, moved.stderr[-3000:]
    moved = Trained(moved.run_dir)
    assert moved.result["resumed_step"] == 2  # a new run directory: its records start after the checkpoint
    saved = ckpt.trainer_state(checkpoints / "step_00000002")["model"]  # converted: still the saving run's record
    assert saved == ckpt.model_record(load_run_config(moved.run_dir)) and saved["backend"] == "megatron"
    assert_same_training(uninterrupted["pp2"].after(2), moved, ANOTHER_LAYOUT)


# Wide enough that the checkpoint (~440 MB) stands well above the host memory's sampling noise.
WIDE = ["train.steps=4", "model.hidden_size=512", "model.ffn_hidden_size=1536", "model.num_attention_heads=8"]


def rank_bytes(checkpoint) -> dict[int, int]:
    """Bytes each rank wrote into a dist_checkpointing save (its files: __RANK_THREAD.distcp)."""
    written = {}
    for path in (checkpoint / "model_optim").glob("__*.distcp"):
        rank = int(path.name.split("_")[2])
        written[rank] = written.get(rank, 0) + path.stat().st_size
    return written


def test_each_rank_writes_its_share_and_another_dp_resumes(tmp_path):
    """dp=2: each rank writes half the checkpoint (its own optimizer shard, half the replicated
    weights) and holds less than that in host memory while writing: no gather, as the fully
    reshardable format did (every rank held the whole optimizer state). The step-2 checkpoint
    resumes on one rank (dp=1) with the dp=2 run's steps 3-4."""
    both = run(tmp_path, "dp2", "cluster.gpus_per_node=2", *WIDE)
    assert both.returncode == 0, both.stderr[-3000:]
    both = Trained(both.run_dir)
    step2 = both.checkpoints / "step_00000002"
    written = rank_bytes(step2)
    share = sum(written.values()) / 2
    assert sorted(written) == [0, 1] and max(written.values()) <= 1.1 * share, written
    held = json.loads((step2 / ckpt.MANIFEST).read_text())["write_peak_extra_bytes"]
    assert max(held) <= 1.1 * share, (held, share)
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(step2, checkpoints / step2.name)
    (checkpoints / ckpt.LATEST).write_text(step2.name + "\n")
    one = run(tmp_path, "dp1", "cluster.gpus_per_node=1", *WIDE, f"checkpoint.dir={checkpoints}")
    assert one.returncode == 0, one.stderr[-3000:]
    one = Trained(one.run_dir)
    assert one.result["resumed_step"] == 2
    assert_same_training(both.after(2), one, ANOTHER_LAYOUT)


def test_killed_rank_restarts_and_resumes_exactly(tmp_path, uninterrupted):
    result = run(
        tmp_path, "restart", *PP2, "train.fault.kill_rank=1", "train.fault.kill_at_step=3", "train.fault.max_restarts=1"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    restarted = Trained(result.run_dir)
    assert restarted.result["restarts"] == 1 and restarted.result["resumed_from"].endswith("step_00000002")
    assert_same_training(uninterrupted["pp2"], restarted, EXACT)


@pytest.fixture(scope="module")
def corrupt_newest(tmp_path_factory):
    """A pp2 run whose step-4 checkpoint is damaged after publishing; rank 0 dies at step 5."""
    stopped = run(
        tmp_path_factory.mktemp("corrupt"),
        "run",
        *PP2,
        "train.fault.corrupt_checkpoint_at_step=4",
        "train.fault.kill_rank=0",
        "train.fault.kill_at_step=5",
    )
    assert stopped.returncode != 0
    return stopped.run_dir


def assert_resumed_before_the_corrupt_checkpoint(run: Trained) -> None:
    assert run.result["resumed_from"] is not None and run.result["resumed_from"].endswith("step_00000002"), run.result
    (unusable,) = run.result["unusable_checkpoints"]
    assert unusable["checkpoint"] == "step_00000004" and "fails its xxh3 checksum" in unusable["problem"]


def test_corrupt_newest_checkpoint_is_detected_and_the_previous_one_used(tmp_path, uninterrupted, corrupt_newest):
    shutil.copytree(corrupt_newest, tmp_path / "run")
    result = run(tmp_path, "run", *PP2)
    assert result.returncode == 0, result.stderr[-3000:]
    # the resume's console: parakit's lines, not torch.distributed.checkpoint's notices to megatron-core
    assert "Warning: " not in result.stderr, result.stderr[-3000:]
    again = Trained(result.run_dir)
    assert_resumed_before_the_corrupt_checkpoint(again)
    assert_same_training(uninterrupted["pp2"], again, EXACT)
    # the damaged step 4 set aside at the resume (said once), then saved again: kept beside, not overwritten
    root = again.run_dir / "checkpoints"
    assert result.stderr.count("set aside as") == 1, result.stderr[-3000:]
    assert ckpt.verify(root / "step_00000004") is None
    assert "fails its xxh3 checksum" in ckpt.verify(root / ".step_00000004.rejected")


def damage_a_record_header(directory) -> None:
    """Flip a byte of a tensor record's pickle (torch.save's data.pkl) in the checkpoint's largest
    shard: reading it raises inside torch.distributed.checkpoint, whose CheckpointException is a
    BaseException, not an Exception (what corrupt's flip in tensor bytes leaves to the checksum)."""
    shard = max((directory / "model_optim").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    pickle_start = data.find(b"\x80\x02", data.index(b"data.pkl", len(data) // 2))
    data[pickle_start + 6] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_a_run_whose_every_checkpoint_is_damaged_refuses_to_start_over(tmp_path, corrupt_newest):
    """Step 4 damaged by the run in tensor bytes (the load succeeds, the checksum fails), step 2 here
    in a record's header (the load itself fails on a rank): the resume names both and exits 1,
    and so does a start from step 0 (checkpoint.resume=false) over them; neither touches the
    checkpoints."""
    shutil.copytree(corrupt_newest, tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    damage_a_record_header(root / "step_00000002")
    before = sorted((p.relative_to(root), p.stat().st_mtime_ns) for p in root.rglob("*"))
    for extra in ([], ["checkpoint.resume=false"]):
        result = run(tmp_path, "run", *PP2, *extra)
        assert result.returncode == 1, result.stderr[-3000:]
        assert "Traceback" not in result.stderr and "Fix: " in result.stderr
        named = ["step_00000004: ", "step_00000002: "] if not extra else ["(step_00000002, step_00000004)"]
        assert all(name in result.stderr for name in named), result.stderr[-3000:]
        assert sorted((p.relative_to(root), p.stat().st_mtime_ns) for p in root.rglob("*")) == before


@pytest.mark.mutation
def test_corrupt_checkpoint_check_catches_a_resume_that_gives_up(tmp_path, corrupt_newest):
    again = resumed(tmp_path, corrupt_newest, *PP2, STOP_AT_3, mutation="resume_gives_up")
    with pytest.raises(AssertionError):
        assert_resumed_before_the_corrupt_checkpoint(again)


def test_crash_during_save_leaves_no_checkpoint_marked_good(tmp_path):
    result = run(tmp_path, "run", *PP2, "train.fault.crash_in_save_at_step=4")
    assert result.returncode != 0
    root = result.run_dir / "checkpoints"
    assert (root / ckpt.LATEST).read_text().strip() == "step_00000002"
    assert (root / ".step_00000004.partial").exists() and not (root / "step_00000004").exists()
    assert ckpt.find_resumable(root) == root / "step_00000002"


def test_stalled_rank_is_detected_and_named_within_the_timeout(tmp_path):
    result = run(
        tmp_path,
        "stall",
        *PP2,
        "train.fault.stall_rank=1",
        "train.fault.stall_at_step=3",
        "train.fault.stall_seconds=600",
        "train.fault.watchdog_timeout_s=6",
        timeout=300,
    )
    assert result.returncode != 0
    assert "watchdog" in result.stderr and "rank(s) [1] stuck at step 3" in result.stderr
    assert result.seconds < 120


def test_nan_loss_stops_with_the_last_good_checkpoint_or_skips_the_step(tmp_path):
    """The NaN enters the loss before the backward pass (the gradients are NaN too, as the
    message says); stop keeps the step-2 checkpoint, skip drops the update and goes on."""
    stopped = run(tmp_path, "stop", *PP2, "train.fault.nan_at_step=3")
    assert stopped.returncode != 0 and "non-finite loss nan and gradients at step 3" in stopped.stderr
    assert not (stopped.run_dir / "result.json").exists()
    assert ckpt.find_resumable(stopped.run_dir / "checkpoints").name == "step_00000002"
    skipped = run(tmp_path, "skip", *PP2, "train.fault.nan_at_step=3", "train.fault.nan_action=skip")
    assert "non-finite loss nan and gradients at step 3: update skipped" in skipped.stdout
    steps = records(skipped)
    assert [r["skipped"] for r in steps] == [False, False, True, False, False, False]
    assert steps[2]["lr"] == steps[1]["lr"] and steps[3]["lr"] != steps[2]["lr"]  # the schedule waited a step
    assert all(x == x for x in losses(skipped)[3:])  # finite again: no NaN reached the weights


def test_async_save_resumes_like_the_uninterrupted_run(tmp_path, uninterrupted):
    """The step-4 save is still in flight when rank 0 dies at the start of step 5: it is never
    published, and the run resumes from step 2 with the uninterrupted losses."""
    stopped = run(
        tmp_path, "run", *PP2, "checkpoint.async_save=true", "train.fault.kill_rank=0", "train.fault.kill_at_step=5"
    )
    assert stopped.returncode != 0
    root = stopped.run_dir / "checkpoints"
    assert ckpt.find_resumable(root) == root / "step_00000002" and not (root / "step_00000004").exists()
    again = run(tmp_path, "run", *PP2, "checkpoint.async_save=true")
    assert again.returncode == 0, again.stderr[-3000:]
    again = Trained(again.run_dir)
    assert again.result["resumed_from"].endswith("step_00000002")
    assert_same_training(uninterrupted["pp2"], again, EXACT)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000004", "step_00000006"]
    assert all(ckpt.verify(p) is None for p in root.glob("step_*"))


def test_interval_by_the_planners_rule(tmp_path):
    result = run(tmp_path, "auto", *PP2, *AUTO_INTERVAL)
    check_planned_interval(result, *COMMON, *PP2, *AUTO_INTERVAL)


# ------------------------------------------------------------------ several nodes (Slurm)
@pytest.fixture(scope="module")
def preempted_on_two_nodes(slurm_env, tmp_path_factory):
    """The uninterrupted tp2 pp2 vpp2 run with dropout as a Slurm job on 2 nodes x 2 ranks (tp
    inside a node, pp across the two), followed by `parakit train`; once step 3 is logged the
    batch shell gets USR1 as from `#SBATCH --signal=B:USR1@S` before the time limit."""
    tmp = tmp_path_factory.mktemp("slurm_two_nodes")
    two_nodes = [o for o in LONG_WITH_DROPOUT if not o.startswith("cluster.gpus_per_node")]
    # no scheduled save before the last step: the preemption's checkpoint is the one it resumes from
    common = [o for o in COMMON if not o.startswith("checkpoint.interval_steps")] + ["checkpoint.interval_steps=6"]
    args = [*common, *two_nodes, "cluster.nodes=2", "cluster.gpus_per_node=2", "cluster.slurm.partition=debug"]
    job = Following([*args, f"hydra.run.dir={tmp / 'run'}"], slurm_env, tmp)
    job_id = job.job_id()
    wait_for_step(tmp / "run", 3, job)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm_env, check=True)
    # Slurm holds a requeued job back for two minutes (its BeginTime), as an admin can skip
    deadline = time.monotonic() + 120
    while job_state(job_id, slurm_env) != "PENDING" and job.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    # not at once: slurmd revokes the ended incarnation's credential with one-second resolution, and
    # a relaunch in the same second is refused ("Job credential revoked") and the job fails
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+2"], env=slurm_env, capture_output=True)
    return job, job.wait(timeout_s=600), tmp / "run"


@pytest.mark.slow
def test_multi_node_slurm_job_equals_the_one_node_run(uninterrupted, preempted_on_two_nodes):
    job, code, run_dir = preempted_on_two_nodes
    assert code == 0, job.output[-4000:]
    # rank 0's node log: either node's (c10d rendezvous orders the agents by host name and pid,
    # the same host name on this machine), and the other node's log is followed too
    assert re.search(r"\[node[12]\] planner: predicted step", job.output), job.output[-4000:]
    assert "[node1] " in job.output and "[node2] " in job.output, job.output[-4000:]
    assert_same_training(uninterrupted["long"], Trained(run_dir), EXACT)


@pytest.mark.slow
def test_slurm_preemption_checkpoints_requeues_and_resumes_exactly(preempted_on_two_nodes):
    job, code, run_dir = preempted_on_two_nodes
    stopped = re.search(r"preempted: stopped after step (\d+) with its checkpoint", job.output)
    assert stopped and "requeueing job" in job.output and code == 0, job.output[-4000:]
    result = Trained(run_dir).result
    assert result["resumed_step"] == int(stopped.group(1)) >= 3 and result["resumed_from"], result
    assert "ended COMPLETED" in job.output and not (run_dir / "preempted").exists()


@pytest.mark.slow
def test_multi_node_slurm_node_lost_mid_run_is_named(slurm_env, tmp_path):
    """pp2 across two nodes (a rank each); once step 1 is logged every process of node2 is killed
    (tests/slurm_cluster.py kill_node): the job ends, not hangs, and parakit names node2."""
    args = [*COMMON, "train.steps=40", "parallel.pp=2", "cluster.nodes=2", "cluster.gpus_per_node=1"]
    job = Following([*args, "cluster.slurm.partition=debug", f"hydra.run.dir={tmp_path / 'run'}"], slurm_env, tmp_path)
    job_id = job.job_id()
    wait_for_step(tmp_path / "run", 1, job)
    assert kill_node(job_id, "node2")
    assert job.wait(timeout_s=120) == 1, job.output[-4000:]
    assert re.search(rf"Slurm job {job_id} ended FAILED.*\n.*node node2 was lost", job.output), job.output[-4000:]


@pytest.mark.slow
def test_multi_node_two_torchrun_agents_without_slurm_restart_and_equal_the_one_node_run(
    tmp_path, uninterrupted, free_port
):
    """launch.sh of pp2 over 2 nodes, run twice on this machine as on two nodes (no Slurm: c10d
    rendezvous at MASTER_ADDR), a rank each; the second node's rank dies at step 3 and both agents
    restart (max_restarts=1) from step 2: the same training as the one-node pp2 run, bit for bit.
    (Each agent counts its own restarts: without a fresh store per attempt the restarted ranks met
    under different attempts' keys and hung.)"""
    generated = training_runs.run(
        tmp_path,
        "run",
        *COMMON,
        "parallel.pp=2",
        "cluster.nodes=2",
        "cluster.gpus_per_node=1",
        "train.fault.kill_rank=1",
        "train.fault.kill_at_step=3",
        "train.fault.max_restarts=1",
        command="generate",
    )
    assert generated.returncode == 0, generated.stderr[-3000:]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port), "RDZV_ID": "two-agents"}
    env.pop("SLURM_JOB_ID", None)
    agents = [
        subprocess.Popen(["bash", str(generated.run_dir / "launch.sh")], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for _ in range(2)
    ]  # fmt: skip
    try:
        outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    finally:  # a hung agent must not outlive the test (its ranks would slow every test after it)
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    restarted = Trained(generated.run_dir)
    assert restarted.result["restarts"] == 1 and restarted.result["resumed_from"].endswith("step_00000002")
    assert_same_training(uninterrupted["pp2"], restarted, EXACT)
