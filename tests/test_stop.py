"""A stop stops everything (toolkit.train.stop): SIGTERM or SIGINT to `parakit train` ends torchrun
and every rank with exit code 128 + the signal; with train.fault.save_on_stop the ranks first finish
the step and publish its checkpoint; a parakit killed outright takes its ranks with it. The same
stop runs under `parakit sweep` and `reproduce` (toolkit.train.stop.run_group)."""

import signal
import subprocess
import sys
import time

import pytest
from training_runs import jsonl, processes_naming

from toolkit.train import checkpoint as ckpt

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_processes_left_behind")]

# Many cheap steps: the signal always arrives while the ranks train.
TINY = ["model=tiny", "model.num_layers=1", "model.vocab_size=2048", "model.seq_length=32", "data=synthetic"]
LONG = [*TINY, "precision=fp32", "train.steps=2000", "train.global_batch=4", "train.micro_batch=1"]
TWO_RANKS = ["cluster.gpus_per_node=2"]


def start(tmp_path, command, *overrides, run="hydra.run.dir=run") -> tuple[subprocess.Popen, object]:
    """`parakit COMMAND` in a fresh interpreter (its own signal handling is the subject). Its
    output goes to files, not pipes: a process left writing to a closed pipe would die of it."""
    argv = [sys.executable, "-m", "toolkit.cli", *command.split(), *overrides, run]
    out, err = (open(tmp_path / name, "w") for name in ("stdout.txt", "stderr.txt"))
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=out, stderr=err, text=True)
    proc.output = lambda: tuple((tmp_path / name).read_text() for name in ("stdout.txt", "stderr.txt"))
    return proc, tmp_path / "run"


def wait_for(proc, ready, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.output()
        assert time.monotonic() < deadline, "no training step in time"
        time.sleep(0.2)


def wait_for_steps(proc, metrics, steps: int = 2) -> None:
    wait_for(proc, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= steps)


def stopped(proc, signum, timeout: float = 120) -> tuple[str, str]:
    proc.send_signal(signum)
    proc.wait(timeout=timeout)
    out, err = proc.output()
    assert proc.returncode == 128 + signum, out[-2000:] + err[-3000:]
    assert f"stopped by {signal.Signals(signum).name}" in err and "Traceback" not in err, err[-3000:]
    return out, err


def assert_nothing_left(tmp_path, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while left := processes_naming(str(tmp_path)):
        assert time.monotonic() < deadline, f"processes of the run left: {left}"
        time.sleep(0.5)


def test_a_signal_to_parakit_train_ends_torchrun_and_every_rank(tmp_path):
    """SIGTERM here; SIGINT takes the same path (toolkit.train.stop.STOP_SIGNALS), tested below on one rank."""
    proc, run_dir = start(tmp_path, "train", *LONG, *TWO_RANKS)
    wait_for_steps(proc, run_dir / "metrics.jsonl")
    stopped(proc, signal.SIGTERM)
    assert_nothing_left(tmp_path)
    assert not (run_dir / "result.json").exists()  # not a finished run


def test_save_on_stop_publishes_the_step_it_stopped_at(tmp_path):
    proc, run_dir = start(tmp_path, "train", *LONG, *TWO_RANKS, "train.fault.save_on_stop=true")
    wait_for_steps(proc, run_dir / "metrics.jsonl")
    out, _ = stopped(proc, signal.SIGTERM)
    assert "saving after this step" in out
    last = jsonl(run_dir)[-1]["step"]
    root = run_dir / "checkpoints"
    assert (root / ckpt.LATEST).read_text().strip() == ckpt.step_name(last) and 1 < last < 2000
    assert ckpt.verify(root / ckpt.step_name(last)) is None
    assert (run_dir / "preempted").read_text().strip() == str(last)
    assert_nothing_left(tmp_path)


def test_one_rank_in_this_process_stops_without_a_traceback(tmp_path):
    proc, run_dir = start(tmp_path, "train", *LONG, "cluster.gpus_per_node=1")
    wait_for_steps(proc, run_dir / "metrics.jsonl")
    stopped(proc, signal.SIGINT)


def test_ranks_do_not_outlive_a_parakit_killed_outright(tmp_path):
    """SIGKILL leaves parakit no say: torchrun gets SIGTERM from the kernel (PR_SET_PDEATHSIG)."""
    proc, run_dir = start(tmp_path, "train", *LONG, *TWO_RANKS)
    wait_for_steps(proc, run_dir / "metrics.jsonl")
    proc.kill()
    proc.wait()
    assert_nothing_left(tmp_path)


def test_a_signal_to_a_sweep_ends_its_point_and_the_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    proc, _ = start(tmp_path, "sweep", *LONG, *TWO_RANKS, "parallel.pp=1,2", run=f"hydra.sweep.dir={sweep}")
    wait_for(proc, lambda: any(p.stat().st_size for p in sweep.rglob("metrics.jsonl")))
    stopped(proc, signal.SIGTERM)
    assert_nothing_left(tmp_path)
    assert not list(sweep.rglob("result.json"))  # the stopped point did not finish
    assert len(list(sweep.rglob("metrics.jsonl"))) == 1  # and the next one never started
