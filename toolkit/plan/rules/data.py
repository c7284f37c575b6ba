"""The training data: its files, its manifest and tokenizer against the model's vocabulary, and
the split."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

from toolkit.config.schema import TOKENIZER_VOCAB, Config, DataName
from toolkit.formats.manifest import manifest_path, parse_blend, read_manifest
from toolkit.plan.rules.base import Violation, err


def _split(text: str) -> list[float] | None:
    """data.split as Megatron-LM reads it: up to three comma-separated non-negative shares."""
    try:
        shares = [float(part) for part in text.replace("/", ",").split(",")]
    except ValueError:
        return None
    if not 1 <= len(shares) <= 3 or any(not math.isfinite(x) or x < 0 for x in shares) or shares[0] <= 0:
        return None
    return shares + [0.0] * (3 - len(shares))


def _prefixes(d) -> Iterator[Violation | str]:
    """data.path's prefixes, or the violations that make them unreadable."""
    try:
        prefixes, _ = parse_blend(d.path)
    except ValueError as e:
        yield err("data_path", {"data.path": d.path}, str(e), "give one prefix, or 'W1 PREFIX1 W2 PREFIX2 ...'")
        return
    for prefix in prefixes:
        missing = [s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
        if missing:
            yield err(
                "data_path",
                {"data.path": prefix},
                f"no {' or '.join(prefix + s for s in missing)}",
                f"prepare it: parakit data prepare FILES... --output {prefix}",
            )
        else:
            yield prefix


def data(cfg: Config) -> Iterator[Violation]:
    """The data exists, every token id of its tokenizer has an embedding row, the blend's parts
    share one tokenizer, and the split leaves validation documents when evaluation is asked for."""
    d, m = cfg.data, cfg.model
    shares = _split(d.split)
    if shares is None:
        yield err(
            "data_split",
            {"data.split": d.split},
            "not train,valid,test shares (non-negative numbers, train above 0)",
            "use e.g. data.split='98,2,0' (quoted: Hydra reads a bare 98,2,0 as a sweep)",
        )
    elif d.name == DataName.corpus and cfg.train.eval_interval and shares[1] == 0:
        yield err(
            "eval_split",
            {"train.eval_interval": cfg.train.eval_interval, "data.split": d.split},
            "evaluation needs validation documents, and the split gives them none",
            "give the validation part a share, e.g. data.split='98,2,0', or set train.eval_interval=null",
        )
    if d.name != DataName.corpus:
        return
    vocabularies = {}  # tokenizer -> (vocab, prefixes)
    if d.path:
        for item in _prefixes(d):
            if isinstance(item, Violation):
                yield item
                continue
            try:  # the ranks read it too (toolkit.train.data)
                manifest = read_manifest(item)
            except (ValueError, TypeError, AttributeError) as e:
                yield err(
                    "data_manifest",
                    {"data.path": item},
                    f"{manifest_path(item)} is not a manifest parakit data prepare wrote ({type(e).__name__}: {e})",
                    f"prepare it again: parakit data prepare FILES... --output {item} --overwrite",
                )
                continue
            key = (manifest.tokenizer, manifest.vocab_size, manifest.eod) if manifest else (d.tokenizer, None, None)
            vocabularies.setdefault(key, []).append(item)
    else:
        vocabularies[(d.tokenizer, None, None)] = ["the bundled corpus"]
    if len(vocabularies) > 1:
        yield err(
            "data_tokenizer",
            {"data.path": d.path},
            "the blend's datasets were tokenized differently: "
            + "; ".join(
                f"{', '.join(p)} with {t} ({v or TOKENIZER_VOCAB.get(t)} tokens)"
                for (t, v, _), p in vocabularies.items()
            ),
            "prepare every part with the same --tokenizer",
        )
    for (tokenizer, vocab, _), prefixes in vocabularies.items():
        tokens = vocab or TOKENIZER_VOCAB.get(tokenizer)
        if tokens is not None and m.vocab_size < tokens:
            yield err(
                "vocab_tokenizer",
                {
                    "model.vocab_size": m.vocab_size,
                    "data.name": d.name,
                    "data.path": d.path,
                    "data.tokenizer": tokenizer,
                },
                f"{', '.join(prefixes)} is tokenized with {tokenizer} ({tokens} tokens): token ids from "
                f"{m.vocab_size} up have no embedding row",
                f"set model.vocab_size={tokens} (or larger), or use data=synthetic (random tokens below "
                "model.vocab_size)",
            )
