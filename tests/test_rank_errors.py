"""Errors from the ranks, once (toolkit.train.rank_errors, toolkit.train.torchrun): each failed rank
records its cause in torchrun's error file and its traceback in RUN_DIR/errors/; the launcher
prints one message naming the rank(s) that failed first, the cause and where the traceback is,
instead of a traceback per rank and torchrun's ChildFailedError."""

import re
import shutil
from pathlib import Path

import pytest
import training_runs
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from toolkit.train import rank_errors

QWEN2_CONFIG = Path(__file__).parent / "data" / "hf_qwen2" / "config.json"


def _fail(monkeypatch, tmp_path, rank: int, error: Exception | str, exitcode: int = 1) -> ProcessFailure:
    """Rank `rank` fails as a parakit rank does under torchrun; the failure as torchrun's agent reads it."""
    error_file = tmp_path / "torchelastic" / str(rank) / "error.json"
    error_file.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", str(rank))
    if isinstance(error, str):
        rank_errors.known(error)
    else:
        try:
            raise error
        except Exception as raised:
            assert rank_errors.unexpected(raised, tmp_path / "run")
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(error_file))


def test_the_first_cause_is_printed_once_with_its_ranks_and_traceback(monkeypatch, tmp_path, capsys):
    first = _fail(monkeypatch, tmp_path, 1, ValueError("a bad value"))
    later = _fail(monkeypatch, tmp_path, 0, RuntimeError("Connection closed by peer"))  # a consequence, later
    stopped = ProcessFailure(local_rank=2, pid=102, exitcode=143, error_file="/nonexistent")  # torchrun's SIGTERM
    assert capsys.readouterr() == ("", "")  # the ranks print nothing: no restart is left
    text = rank_errors.summary({0: later, 1: first, 2: stopped})
    traceback = tmp_path / "run" / "errors" / "rank1.txt"
    assert text.splitlines() == [
        "parakit train: rank 1 failed first: ValueError: a bad value",
        f"  traceback: {traceback}",
        "  then rank 0: RuntimeError: Connection closed by peer",
    ]
    assert "raise error" in traceback.read_text() and "ValueError: a bad value" in traceback.read_text()


def test_one_cause_on_every_rank_is_one_line_and_a_known_error_has_no_traceback(monkeypatch, tmp_path, capsys):
    same = {r: _fail(monkeypatch, tmp_path / str(r), r, ValueError("the same on each")) for r in (0, 1)}
    assert rank_errors.summary(same).splitlines()[0] == "parakit train: ranks 0, 1 failed: ValueError: the same on each"
    known = {r: _fail(monkeypatch, tmp_path / f"k{r}", r, "resume: no checkpoint fits; fix it", 1) for r in (0, 1)}
    assert rank_errors.summary(known) == "parakit train: ranks 0, 1 failed: resume: no checkpoint fits; fix it"
    assert capsys.readouterr().err == ""


def test_a_rank_says_it_failed_when_torchrun_restarts_and_raises_without_torchrun(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    _fail(monkeypatch, tmp_path, 1, ValueError("first attempt"))
    assert "rank 1 failed: ValueError: first attempt" in capsys.readouterr().err  # the launcher hears only the last
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    assert not rank_errors.unexpected(ValueError("no agent"), tmp_path)  # the caller lets it raise
    rank_errors.known("printed here")
    assert capsys.readouterr().err == "parakit train: printed here\n"


@pytest.mark.slow
@pytest.mark.usefixtures("no_processes_left_behind")
def test_an_exception_on_every_rank_reaches_the_user_once(tmp_path):
    """Weights that are there (the validator checks that) but are no safetensors file (a partial
    download): every rank's HfTensors raises, which no check before launch reads far enough to see."""
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(QWEN2_CONFIG, hf)
    (hf / "model.safetensors").write_text("not safetensors: a partial download")
    result = training_runs.run(
        tmp_path,
        "run",
        "model=hf",
        f"model.hf_path={hf}",
        "data=synthetic",
        "precision=fp32",
        "cluster.gpus_per_node=2",
        "train.steps=2",
        "train.global_batch=4",
        "train.micro_batch=2",
        "optim.warmup_steps=0",
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    cause = "SafetensorError: Error while deserializing header"
    assert out.count(cause) == 1, out[-3000:]
    named = re.search(r"parakit train: ranks? ([01](?:, 1)?) failed: " + cause, out)
    assert named, out[-3000:]  # both ranks, unless torchrun stopped the slower before it raised
    assert "ChildFailedError" not in out and "Traceback" not in out, out[-3000:]
    first = re.search(r"  traceback: (\S+)", out)  # the rank that failed first
    assert first and Path(first[1]).parent == result.run_dir / "errors", out[-3000:]
    assert Path(first[1]).stem in {f"rank{r}" for r in named[1].split(", ")}
    assert "HfTensors" in Path(first[1]).read_text() and cause in Path(first[1]).read_text()
