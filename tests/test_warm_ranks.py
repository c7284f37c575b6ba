"""The suite's warm ranks (tests/warm): torchrun still sees each rank's exit code, stops the
survivors with SIGTERM, and a rank whose import-time environment differs runs cold."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

RANK = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path

    out = Path(sys.argv[1])
    rank = os.environ.get("RANK", "0")
    (out / f"warm-{rank}").write_text(str("megatron.core" in sys.modules))  # imported before it started
    if rank == "1":
        sys.exit(3)  # a failing rank: torchrun tears the job down
    signal.signal(signal.SIGTERM, lambda *_: ((out / "terminated").write_text("yes"), os._exit(143)))
    time.sleep(120)
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "rank.py"
    path.write_text(RANK)
    return path


def test_torchrun_sees_a_rank_fail_and_stops_the_other(tmp_path, script, warm_ranks, no_processes_left_behind):
    if warm_ranks is None:
        pytest.skip("PARAKIT_COLD_RANKS=1")
    for _ in range(600):  # the server imports for ~10 s after the session starts
        if Path(warm_ranks).exists():
            break
        time.sleep(0.1)
    started = time.monotonic()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run([*torchrun, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "exitcode  : 3" in done.stderr, done.stderr[-3000:]
    assert (tmp_path / "warm-0").read_text() == (tmp_path / "warm-1").read_text() == "True"
    assert (tmp_path / "terminated").read_text() == "yes"  # SIGTERM reached the forked rank
    assert time.monotonic() - started < 60  # not the survivor's 120 s sleep


def test_a_rank_with_another_import_environment_runs_cold(tmp_path, script, warm_ranks):
    if warm_ranks is None:
        pytest.skip("PARAKIT_COLD_RANKS=1")
    env = {**os.environ, "RANK": "1", "PYTHONPATH": str(tmp_path)}  # as a mutation's sitecustomize folder
    done = subprocess.run([os.environ["PYTHON_EXEC"], "-u", str(script), str(tmp_path)], env=env, timeout=60)
    assert done.returncode == 3 and (tmp_path / "warm-1").read_text() == "False"
