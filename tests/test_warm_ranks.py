"""The suite's warm ranks (tests/warm): torchrun still sees each rank's exit code, stops the
survivors with SIGTERM, a rank whose import-time environment differs runs cold, and one whose
PYTHONPATH adds a folder runs warm with that folder's sitecustomize."""

import json
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
def warm(warm_ranks):
    """The warm server, once it is ready (it imports for ~10 s after the session starts)."""
    if warm_ranks is None:
        pytest.skip("PARAKIT_COLD_RANKS=1")
    for _ in range(600):
        if Path(warm_ranks).exists():
            break
        time.sleep(0.1)
    return warm_ranks


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "rank.py"
    path.write_text(RANK)
    return path


def test_torchrun_sees_a_rank_fail_and_stops_the_other(tmp_path, script, warm, no_processes_left_behind):
    started = time.monotonic()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run([*torchrun, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "exitcode  : 3" in done.stderr, done.stderr[-3000:]
    assert (tmp_path / "warm-0").read_text() == (tmp_path / "warm-1").read_text() == "True"
    assert (tmp_path / "terminated").read_text() == "yes"  # SIGTERM reached the forked rank
    assert time.monotonic() - started < 60  # not the survivor's 120 s sleep


@pytest.mark.parametrize("differs", ["hash seed", "shadowing folder"])
def test_a_rank_with_another_import_environment_runs_cold(tmp_path, script, warm, differs):
    env = {**os.environ, "RANK": "1"}
    if differs == "hash seed":
        env["PYTHONHASHSEED"] = "7"  # read at start-up
    else:  # a folder whose psutil a cold start would import instead of the one the server has
        (tmp_path / "shadow").mkdir()
        (tmp_path / "shadow" / "psutil.py").write_text("")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path / "shadow"), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([os.environ["PYTHON_EXEC"], "-u", str(script), str(tmp_path)], env=env, timeout=60)
    assert done.returncode == 3 and (tmp_path / "warm-1").read_text() == "False"


CUSTOMIZED = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    customized = sys.modules.get("sitecustomize")  # imported before the program started
    warm = "megatron.core" in sys.modules
    import torch

    facts = {"customized": customized and customized.__file__, "path": sys.path[1], "threads": torch.get_num_threads()}
    Path(sys.argv[1]).write_text(json.dumps({"warm": warm, "python": sys.executable, "facts": facts}))
""")


@pytest.mark.parametrize("threads", [None, "1"])
def test_pythonpath_folders_and_threads_are_set_up_as_at_a_cold_start(tmp_path, warm, threads):
    """A mutation's folder (tests/mutants) put in front of PYTHONPATH, and OMP_NUM_THREADS set or
    not: the warm rank has the folder first on sys.path with its sitecustomize imported before the
    program, and torch's thread count, as a cold start has them; its own Python children go
    through the client."""
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text("")
    (tmp_path / "program.py").write_text(CUSTOMIZED)
    env = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    env.update({"OMP_NUM_THREADS": threads} if threads else {})
    seen = {}
    for python in (os.environ["PYTHON_EXEC"], sys.executable):
        out = tmp_path / f"{len(seen)}.json"
        assert subprocess.run([python, str(tmp_path / "program.py"), str(out)], env=env, timeout=60).returncode == 0
        seen[python] = json.loads(out.read_text())
    warm_run, cold_run = seen.values()
    assert warm_run["warm"] and not cold_run["warm"]
    assert warm_run["python"] == os.environ["PYTHON_EXEC"]
    assert warm_run["facts"] == cold_run["facts"]
    assert cold_run["facts"]["customized"] == str(folder / "sitecustomize.py")
