"""data.path, data.split and train.eval_* as the validator, the summary and Megatron-LM's
arguments read them. Prefixes here are stand-ins (empty .bin/.idx and a manifest): the rules
read only the manifest and check that the files exist."""

from __future__ import annotations

from pathlib import Path

import pytest
from megatron_lm import FLAGS

from toolkit.emit.files import render
from toolkit.formats.manifest import Manifest, manifest_path, parse_blend
from toolkit.plan.layout import resolve
from toolkit.plan.validate import validate


def fake_prefix(directory: Path, name: str, tokenizer: str = "/tok/a", vocab: int = 76_000) -> str:
    prefix = directory / name
    for suffix in (".bin", ".idx"):
        Path(f"{prefix}{suffix}").touch()
    Manifest(tokenizer, "PreTrainedTokenizerFast", vocab, 0, "int32", 10, 100).write(manifest_path(prefix))
    return str(prefix)


def rules(cfg) -> dict[str, str]:
    return {v.rule: str(v) for v in validate(cfg).errors}


@pytest.fixture
def prefixes(tmp_path):
    return {
        "a": fake_prefix(tmp_path, "a"),
        "b": fake_prefix(tmp_path, "b"),
        "other": fake_prefix(tmp_path, "other", tokenizer="/tok/b", vocab=32_000),
        "bare": str(tmp_path / "bare"),  # files but no manifest: Megatron-LM's own preprocessing
        "missing": str(tmp_path / "missing"),
        "torn": fake_prefix(tmp_path, "torn"),  # its manifest cut short below
    }


def test_rules_reject_and_accept_the_neighbour(compose, prefixes):
    for suffix in (".bin", ".idx"):
        Path(prefixes["bare"] + suffix).touch()
    a, b, other = prefixes["a"], prefixes["b"], prefixes["other"]
    manifest_path(prefixes["torn"]).write_text('{"tokenizer": "/tok/a", ')  # the ranks would read it too
    cases = [  # rule, bad overrides, good neighbour, text of the message
        ("data_path", [f"data.path={prefixes['missing']}"], [f"data.path={a}"], "parakit data prepare"),
        ("data_path", [f"data.path='0.5 {a} {b}'"], [f"data.path='0.5 {a} 0.5 {b}'"], "weight-prefix pairs"),
        ("data_path", [f"data.path='x {a} 1 {b}'"], [f"data.path='1 {a} 1 {b}'"], "follows its weight"),
        ("data_manifest", [f"data.path={prefixes['torn']}"], [f"data.path={a}"], "JSONDecodeError"),
        ("data_tokenizer", [f"data.path='0.5 {a} 0.5 {other}'"], [f"data.path='0.5 {a} 0.5 {b}'"], "same --tokenizer"),
        ("vocab_tokenizer", [f"data.path={a}", "model.vocab_size=50257"], [f"data.path={a}"], "model.vocab_size=76000"),
        (
            "vocab_tokenizer",
            [f"data.path={prefixes['bare']}", "model.vocab_size=32000"],
            [f"data.path={other}", "model.vocab_size=32000"],
            "gpt2 (50257",
        ),
        ("data_split", ["data.split='98,x'"], ["data.split='98,2'"], "data.split="),
        ("data_split", ["data.split='0,1,0'"], ["data.split='1,1,0'"], "train above 0"),
        (
            "eval_split",
            ["train.eval_interval=5", "data.split='100,0,0'"],
            ["train.eval_interval=5"],
            "train.eval_interval=null",
        ),
    ]
    for rule, bad, good, text in cases:
        found = rules(compose(*with_vocab(bad)))
        assert rule in found and text in found[rule], (bad, found)
        assert rule not in rules(compose(*with_vocab(good))), (good, rules(compose(*with_vocab(good))))


def with_vocab(overrides: list[str]) -> list[str]:
    """The model's vocabulary covers the stand-in tokenizer's unless the case sets it."""
    return overrides if any("vocab_size" in o for o in overrides) else ["model.vocab_size=76000", *overrides]


def test_blend_parses_as_megatron_lm_reads_it():
    assert parse_blend("/d/a") == (["/d/a"], None)
    assert parse_blend("0.7 /d/a 0.3 /d/b") == (["/d/a", "/d/b"], [0.7, 0.3])
    with pytest.raises(ValueError, match="positive"):
        parse_blend("0 /d/a 1 /d/b")


def test_megatron_lm_args_carry_the_tokenizer_and_evaluation(compose, prefixes):
    cfg = compose("model.vocab_size=76000", f"data.path={prefixes['a']}", "train.eval_interval=50")
    args = " ".join(render(cfg, resolve(cfg))["megatron_args.txt"].split("\n"))
    assert f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {prefixes['a']}.tokenizer" in args
    assert "--eval-interval 50 --eval-iters 10" in args and "--split 98,2,0" in args
    assert {word for word in args.split() if word.startswith("--")} <= FLAGS
    plain = render(compose(), resolve(compose()))["megatron_args.txt"]
    assert "--tokenizer-type NullTokenizer" in plain and "--eval-iters 0" in plain


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_blend_and_split_reach_the_datasets(tmp_path, compose, one_process_group, monkeypatch):
    """Two prepared prefixes blended 3:1 feed the training samples in that proportion, and the
    validation samples come from other documents than the training ones (data.split honoured)."""
    from toolkit.cli import main
    from toolkit.data import corpus
    from toolkit.data.bundled import load_tokenizer
    from toolkit.train.data import build_datasets

    monkeypatch.setattr(corpus, "CACHE", tmp_path / "cache")  # the sample index cache
    for name, word in (("left", "alpha"), ("right", "omega")):
        lines = "".join(f'{{"text": "{word} {i} {word}"}}\n' for i in range(200))
        (tmp_path / f"{name}.jsonl").write_text(lines)
        assert main(["data", "prepare", str(tmp_path / f"{name}.jsonl"), "--output", str(tmp_path / name)]) == 0
    blend = f"data.path='3 {tmp_path / 'left'} 1 {tmp_path / 'right'}'"
    cfg = compose(blend, "model.seq_length=8", "train.steps=25", "train.eval_interval=5", "data.split='90,10,0'")
    data = build_datasets(cfg, resolve(cfg))
    alpha, omega = (load_tokenizer()(" " + w)["input_ids"][0] for w in ("alpha", "omega"))
    left = sum(alpha in data.train[i]["tokens"].tolist() for i in range(400))
    right = sum(omega in data.train[i]["tokens"].tolist() for i in range(400))
    assert 0.65 < left / (left + right) < 0.85, (left, right)
    train_docs = {int(d) for i in range(len(data.train.datasets[0])) for d in _documents(data.train.datasets[0], i)}
    valid_docs = {int(d) for i in range(len(data.valid.datasets[0])) for d in _documents(data.valid.datasets[0], i)}
    assert train_docs and valid_docs and not train_docs & valid_docs


def _documents(gpt_dataset, index: int):
    """The documents GPTDataset sample `index` is cut from (its document and sample indices)."""
    begin, end = (
        gpt_dataset.sample_index[gpt_dataset.shuffle_index[index]],
        gpt_dataset.sample_index[gpt_dataset.shuffle_index[index] + 1],
    )
    return gpt_dataset.document_index[begin[0] : end[0] + 1]
