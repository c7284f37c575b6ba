"""The progress watchdog (one process, world size 1): it ends a process that makes no progress
within its timeout and names the rank, but not while a checkpoint is being written. And the
job's attempt, on which injected faults depend, agreed on by every rank."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import time, torch
    from toolkit.train.faults import Watchdog
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    watchdog = Watchdog(1.0)
    watchdog.beat(1)
    with watchdog.suspended():
        time.sleep(3)  # a long save
    print("survived the save", flush=True)
    watchdog.beat(2)
    time.sleep(10)  # stuck in step 3
    print("not stopped", flush=True)
""")


def test_watchdog_ends_a_stuck_process_but_not_a_long_save():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert "survived the save" in result.stdout and "not stopped" not in result.stdout
    assert result.returncode == 3
    assert "rank(s) [0] stuck at step 3" in result.stderr


# Two ranks as on two nodes whose agents count differently: the first node's agent restarted
# after a failure (1), the second's ranks restarted for the membership change only (0).
AGREED = textwrap.dedent("""
    import os, sys
    import torch.multiprocessing as mp

    def rank_main(rank, port, out):
        os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "1" if rank == 0 else "0"
        from toolkit.train.distributed import end_process_group, init_process_group, job_restarts
        from toolkit.train.faults import first_attempt

        init_process_group()
        open(f"{out}-{rank}", "w").write(f"{job_restarts()} {first_attempt()}")
        end_process_group()

    if __name__ == "__main__":
        mp.spawn(rank_main, args=sys.argv[1:], nprocs=2)
""")


def test_every_rank_agrees_on_the_job_attempt_whatever_its_agent_counts(tmp_path, free_port):
    """An injected fault fires on the job's first attempt only: a rank whose agent counts no
    restart must not fire it again on the second (the job's restarts: the most any agent counts)."""
    script = tmp_path / "agents.py"
    script.write_text(AGREED)
    result = subprocess.run(
        [sys.executable, str(script), str(free_port), str(tmp_path / "seen")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(tmp_path / f"seen-{rank}").read_text() for rank in (0, 1)] == ["1 False", "1 False"]
