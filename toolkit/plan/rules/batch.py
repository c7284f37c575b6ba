"""The batch split: global batch = micro batch x dp x accumulation steps, and what the
interleaved schedule asks of the micro-batches."""

from __future__ import annotations

from typing import Iterator

from toolkit.config.schema import Config
from toolkit.plan.layout import derived_dp
from toolkit.plan.rules.base import Violation, divisors, err, listing


def split(cfg: Config) -> Iterator[Violation]:
    t, p = cfg.train, cfg.parallel
    dp = derived_dp(cfg)
    if dp is None or dp < 1:
        return  # reported by the world_size rule
    per_step = t.micro_batch * dp
    fields = {"train.global_batch": t.global_batch, "train.micro_batch": t.micro_batch, "parallel.dp": dp}
    if t.global_batch % per_step:
        lower = max(per_step, t.global_batch - t.global_batch % per_step)
        micro = [d for d in divisors(t.global_batch // dp) if d <= 64] if t.global_batch % dp == 0 else []
        fix = f"use train.global_batch={lower} or {lower + per_step} (a multiple of micro_batch*dp = {per_step})"
        if micro:
            fix += f", or train.micro_batch in {{{listing(micro)}}}"
        yield err("batch_split", fields, "global batch != micro_batch * dp * grad_accum for any whole grad_accum", fix)
        return
    accum = t.global_batch // per_step
    if t.grad_accum is not None and t.grad_accum != accum:
        yield err(
            "grad_accum",
            {**fields, "train.grad_accum": t.grad_accum},
            f"global_batch / (micro_batch * dp) = {accum} accumulation steps",
            f"set train.grad_accum={accum} or leave it out, or train.global_batch={t.grad_accum * per_step}",
        )
    if p.vpp > 1 and p.pp > 1 and accum % p.pp:
        step = per_step * p.pp
        yield err(
            "vpp_microbatches",
            {**fields, "parallel.pp": p.pp, "parallel.vpp": p.vpp},
            f"the interleaved schedule needs the {accum} micro-batches per step to be a multiple of pp={p.pp}",
            f"use train.global_batch={max(step, t.global_batch - t.global_batch % step)} or "
            f"{t.global_batch - t.global_batch % step + step}",
        )
