import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed: no GPU probing in tests
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*absl.logging is not installed.*")

from training_runs import processes_naming  # noqa: E402
from warm.server import WARM_ENV  # noqa: E402

from toolkit.config.store import compose_config  # noqa: E402

WARM = Path(__file__).parent / "warm"


@pytest.fixture
def compose():
    """compose(*overrides) -> Config, through Hydra exactly as the CLI composes it."""
    return lambda *overrides: compose_config(list(overrides))


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a rendezvous or a store binds it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def machine_probed():
    """This machine measured for the cpu cluster once, before any test composes it: a first
    composition inside a timed subprocess would spend its time measuring."""
    from toolkit.config import machine

    machine.run_probe()


@pytest.fixture(scope="session", autouse=True)
def warm_ranks(tmp_path_factory, machine_probed):
    """torchrun's ranks forked from a process that has imported torch, megatron-core, DeepSpeed and
    transformers (tests/warm/server.py), ~4 s less per launch on 2 cores. PARAKIT_COLD_RANKS=1
    runs every rank cold; a rank whose import-time environment differs (a mutation) runs cold."""
    if os.environ.get("PARAKIT_COLD_RANKS") == "1":
        yield None
        return
    directory = tmp_path_factory.mktemp("warm")
    client = directory / "python"
    client.write_text(f"#!{sys.executable} -IS\n" + (WARM / "client.py").read_text())
    client.chmod(0o755)
    socket_path = directory / "socket"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # no OpenMP pool in the server when it forks; a rank sets its own
    with open(directory / "server.log", "w") as log:
        server = subprocess.Popen([sys.executable, str(WARM / "server.py"), str(socket_path)], env=env,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    # set now: until the server is ready (~10 s) a client runs its rank cold
    os.environ.update(zip(WARM_ENV, (str(client), str(socket_path))))
    yield socket_path
    for name in WARM_ENV:
        os.environ.pop(name, None)
    os.killpg(server.pid, signal.SIGKILL)
    server.wait()


@pytest.fixture
def no_processes_left_behind(tmp_path, warm_ranks):
    """No process of this test's runs (their command lines name its directory) outlives the test."""
    yield
    deadline = time.monotonic() + 2  # a rank that is ending may take a moment to go
    while left := processes_naming(str(tmp_path)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"training processes left behind: {left}"


@pytest.fixture(scope="session")
def deepspeed_zero1_dp2(tmp_path_factory):
    """DeepSpeed ZeRO-1 on 2 ranks, checkpoints at steps 2 and 4: one run for the layout parity
    test (tests/test_train_deepspeed.py) and the universal-checkpoint resume it saves step 2 for
    (tests/test_faults_deepspeed.py)."""
    from training_runs import DEEPSPEED_SHORT, trained

    overrides = ["cluster.gpus_per_node=2", "zero=1", "checkpoint.interval_steps=2"]
    return trained(tmp_path_factory.mktemp("zero1_dp2"), "zero1_dp2", *DEEPSPEED_SHORT, *overrides)


@pytest.fixture(scope="session")
def two_ranks_one_slow(tmp_path_factory):
    """The tiny model on 2 CPU ranks for 6 steps with rank 1 half a second slow at every step (the
    slow-rank drill), compared every 3 steps: one launch for the quiet console's test at two ranks
    (tests/test_console.py) and the drill's (tests/test_stragglers.py)."""
    from training_runs import run

    drill = ["train.fault.slow_rank=1", "train.fault.slow_seconds=0.5", "train.fault.straggler_interval=3"]
    overrides = ["model=tiny", "cluster.gpus_per_node=2", "train.steps=6", "train.log_interval=1"]
    overrides += ["train.global_batch=4", "train.micro_batch=2", "optim.warmup_steps=1", *drill]
    result = run(tmp_path_factory.mktemp("slow_rank"), "slow", *overrides)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory):
    """The bundled corpus as a 4 MB jsonl file, one chapter per line."""
    from data_corpus import write_corpus_jsonl

    return write_corpus_jsonl(tmp_path_factory.mktemp("corpus") / "kjv.jsonl")


@pytest.fixture(scope="session")
def big_tokenizer(tmp_path_factory, corpus_jsonl):
    """A BPE trained on it, vocabulary 76,000, most ordinary ids above 65,535."""
    from data_corpus import train_big_tokenizer

    return train_big_tokenizer(corpus_jsonl, tmp_path_factory.mktemp("tokenizer") / "bpe76k")


@pytest.fixture(scope="session")
def prepared_corpus(tmp_path_factory, corpus_jsonl, big_tokenizer):
    """That corpus prepared with that tokenizer by `parakit data prepare` (2 workers): a prefix."""
    from toolkit.cli import main

    prefix = tmp_path_factory.mktemp("prepared") / "kjv76k"
    args = ["data", "prepare", str(corpus_jsonl), "--output", str(prefix), "--tokenizer", str(big_tokenizer)]
    assert main([*args, "--workers", "2"]) == 0
    return prefix


@pytest.fixture(scope="session")
def slurm_env(tmp_path_factory):
    """The environment in which sbatch reaches a Slurm cluster with partition debug, started once
    for the session where none runs (tests/slurm_cluster.py), or the test skipped with the reason."""
    from slurm_cluster import slurm_cluster

    yield from slurm_cluster(lambda: tmp_path_factory.mktemp("slurm"))
