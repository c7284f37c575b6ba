"""`parakit data prepare`: what it writes (and reads back), its dtype choice, and its errors.

Every bad input gets an error naming the file and line, exit code 2, and nothing under the
output prefix (nor a staging directory) afterwards.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from toolkit.cli import main
from toolkit.compat import import_shims
from toolkit.formats.manifest import read_manifest

import_shims()
from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402


def prepare(*args) -> int:
    return main(["data", "prepare", *map(str, args)])


def outputs(directory) -> list[str]:
    """Everything `data prepare` may have left in `directory` (inputs are *.jsonl/*.txt/*.parquet)."""
    return sorted(p.name for p in directory.iterdir() if p.suffix not in (".jsonl", ".txt", ".parquet", ".csv"))


def test_vocabulary_above_65535_round_trips(tmp_path, big_tokenizer, capsys):
    """A 76,000-token vocabulary is stored as int32 and every id reads back as the tokenizer made
    it (as uint16, the ids above 65,535 would wrap around)."""
    texts = ["And God said, Let there be light: and there was light.", "Jehoshaphat begat Joram; Uzziah."]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert prepare(source, "--output", tmp_path / "big", "--tokenizer", big_tokenizer) == 0
    tokenizer = AutoTokenizer.from_pretrained(str(big_tokenizer))
    expected = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    assert max(max(ids) for ids in expected) > 65535 and len(tokenizer) == 76_000
    dataset = IndexedDataset(str(tmp_path / "big"))
    assert dataset.index.dtype == np.int32
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected
    manifest = read_manifest(tmp_path / "big")
    assert (manifest.vocab_size, manifest.eod, manifest.dtype) == (76_000, tokenizer.eos_token_id, "int32")
    assert (manifest.documents, manifest.tokens) == (2, sum(map(len, expected)))
    assert manifest.sources[0].documents == 2 and len(manifest.sources[0].sha256) == 64
    # the tokenizer travels with the data: the same ids from the copy
    copy = AutoTokenizer.from_pretrained(str(tmp_path / "big.tokenizer"))
    assert copy(texts[0], add_special_tokens=False)["input_ids"] == expected[0][:-1]
    assert "ids stored as int32" in capsys.readouterr().out


def test_gpt2_formats_and_workers_agree(tmp_path, corpus_jsonl, capsys):
    """The bundled GPT-2 BPE fits uint16. jsonl, parquet and plain text give the same tokens, and
    two worker processes write exactly the bytes one does; throughput is printed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = corpus_jsonl.read_text().splitlines()[:40]
    texts = [json.loads(line)["text"] for line in lines]
    (tmp_path / "part.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"body": texts}), tmp_path / "part.parquet")
    for i, text in enumerate(texts[:3]):
        (tmp_path / f"doc{i}.txt").write_text(text)
    assert prepare(tmp_path / "part.jsonl", "--output", tmp_path / "one") == 0
    assert "tokens/s per worker" in capsys.readouterr().out
    assert prepare(tmp_path / "part.jsonl", "--output", tmp_path / "two", "--workers", 2) == 0
    assert prepare(tmp_path / "part.parquet", "--output", tmp_path / "pq", "--text-key", "body") == 0
    assert prepare(*(tmp_path / f"doc{i}.txt" for i in range(3)), "--output", tmp_path / "txt") == 0
    one = IndexedDataset(str(tmp_path / "one"))
    assert one.index.dtype == np.uint16 and len(one) == 40
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    assert (tmp_path / "one.idx").read_bytes() == (tmp_path / "two.idx").read_bytes()
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "pq.bin").read_bytes()
    txt = IndexedDataset(str(tmp_path / "txt"))
    assert [txt[i].tolist() for i in range(3)] == [one[i].tolist() for i in range(3)]
    assert all(one[i][-1] == 50256 for i in range(len(one)))  # each document ends with <|endoftext|>


BAD_INPUTS = {
    "broken JSON": (b'{"text": "fine"}\n{"text": "cut off\n', "bad.jsonl:2: broken JSON"),
    "missing text key": (b'{"text": "fine"}\n{"body": "x"}\n', "bad.jsonl:2: no 'text' key (has ['body'])"),
    "undecodable bytes": (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', "bad.jsonl:2: bytes that are not UTF-8"),
    "empty input": (b"\n\n", "no documents with text in the input"),
    "text not a string": (b'{"text": "fine"}\n{"text": 7}\n', "bad.jsonl:2: 'text' is a int, not text"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_names_file_and_line_and_writes_nothing(tmp_path, capsys, case):
    content, message = BAD_INPUTS[case]
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "one good document first"}\n' * 100 + content)
    if case == "empty input":
        (tmp_path / "bad.jsonl").write_bytes(content)
    assert prepare(tmp_path / "bad.jsonl", "--output", tmp_path / "out") == 2
    err = capsys.readouterr().err
    if case != "empty input":
        message = message.replace("bad.jsonl:2", "bad.jsonl:102")  # after the 100 good lines
    assert message in err and "Traceback" not in err, err
    assert outputs(tmp_path) == []  # no dataset, no manifest, no staging directory


def test_skip_bad_lines_counts_them(tmp_path, capsys):
    lines = [b'{"text": "good one"}', b'{"text": broken', b'{"body": "x"}', b'{"text": "good two"}', b'{"text": ""}']
    (tmp_path / "mixed.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assert prepare(tmp_path / "mixed.jsonl", "--output", tmp_path / "out", "--skip-bad-lines") == 0
    manifest = read_manifest(tmp_path / "out")
    assert (manifest.documents, manifest.skipped_lines, manifest.empty_documents) == (2, 2, 1)
    assert "skipped 2 bad line(s) and 1 document(s) without text" in capsys.readouterr().out


def test_refusals_before_any_work(tmp_path, capsys):
    """A missing file, an unknown format, a missing parquet column, an existing dataset, a bad
    tokenizer directory: refused with the fix, nothing written."""
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "a.csv").write_text("text\nx\n")
    assert prepare(tmp_path / "a.jsonl", "--output", tmp_path / "out") == 0
    cases = [
        ([tmp_path / "missing.jsonl"], "missing.jsonl: no such file"),
        ([tmp_path / "a.csv"], "unknown input format '.csv'"),
        ([tmp_path / "a.jsonl", "--overwrite", "--tokenizer", tmp_path / "nope"], "not a directory"),
        ([tmp_path / "a.jsonl"], "a prepared dataset is already there; pass --overwrite"),
    ]
    for args, message in cases:
        assert prepare(*args, "--output", tmp_path / "out") == 2
        assert message in capsys.readouterr().err
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    assert prepare(tmp_path / "b.parquet", "--output", tmp_path / "pq") == 2
    assert "b.parquet: no 'text' column (has ['body'])" in capsys.readouterr().err
    assert outputs(tmp_path) == ["out.bin", "out.idx", "out.manifest.json", "out.tokenizer"]
