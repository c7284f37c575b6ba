"""The progress watchdog (one process, world size 1): it ends a process that makes no progress
within its timeout and names the rank, but not while a checkpoint is being written."""

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
