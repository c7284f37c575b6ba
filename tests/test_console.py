"""A quiet console (toolkit.train.console): a run's terminal shows parakit's summary, the planner's
prediction and the step lines (with the ETA); megatron-core's INFO logs (its gradient buckets and
every parameter in them: 80 lines for the tiny model) go to the run directory's log files only, and
`--verbose` puts them back on the terminal."""

import logging
import re

import pytest
from training_runs import run

from toolkit.train import console

RUN = ["model=tiny", "train.steps=3", "train.log_interval=1", "train.global_batch=4", "train.micro_batch=2"]
RUN += ["optim.warmup_steps=1"]
NOISE = "Params for bucket"  # megatron-core's param_and_grad_buffer, at INFO


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_console_from_start_to_the_last_step_fits_a_screen(tmp_path, ranks, request):
    """Two ranks: the slow-rank drill's run (tests/conftest.py), whose slow-rank lines count too."""
    if ranks == 1:
        result = run(tmp_path, "run", *RUN, "cluster.gpus_per_node=1")
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    else:
        result = request.getfixturevalue("two_ranks_one_slow")
    terminal = (result.stdout + result.stderr).splitlines()
    assert len(terminal) < 40, "\n".join(terminal)
    assert not [line for line in terminal if NOISE in line or "][INFO]" in line]
    assert any(line.startswith("planner: predicted step") for line in terminal)
    assert "| ETA 0:00:" in next(line for line in terminal if re.match(r"step +1/\d+ \| loss", line))
    log = result.run_dir / ("parakit.log" if ranks == 1 else "logs/rank0.log")
    assert NOISE in log.read_text()


@pytest.mark.slow
def test_verbose_shows_the_other_libraries_logs(tmp_path):
    result = run(tmp_path, "verbose", *RUN, "cluster.gpus_per_node=1", "--verbose")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert NOISE in result.stdout + result.stderr


def test_a_librarys_prints_become_its_loggers_records(caplog, monkeypatch):
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="somelib"), console.prints_logged("somelib"):
        print("MA 2.3 GB  Max_MA 2.3 GB")
        print("before initializing group 0", end="")
    assert [r.getMessage() for r in caplog.records] == ["MA 2.3 GB  Max_MA 2.3 GB", "before initializing group 0"]


def test_the_terminal_filter_lets_warnings_and_parakits_own_lines_through(monkeypatch):
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    keep = console.OtherLibrariesInfo().filter

    def record(name, level):
        return logging.LogRecord(name, level, __file__, 1, "message", None, None)

    assert not keep(record("megatron.core.distributed", logging.INFO))
    assert keep(record("megatron.core.distributed", logging.WARNING))
    assert keep(record("toolkit.report.sweep_slurm", logging.INFO)) and keep(record("hydra", logging.INFO))
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    assert keep(record("megatron.core.distributed", logging.INFO))


def test_verbose_prints_pass_through(monkeypatch, capsys):
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    with console.prints_logged("somelib"):
        print("shown")
    assert capsys.readouterr().out == "shown\n"
