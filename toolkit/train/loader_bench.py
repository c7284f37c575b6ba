"""`parakit data bench`: can the input pipeline keep the planned GPUs busy?

Measures the micro-batches per second one rank's loader makes here (the run's dataset, sample
order, micro-batch size and data.num_workers) and compares them with what one data-parallel rank
consumes: global_batch / dp samples per planner step time (toolkit.plan.perf). A loader slower
than that starves the GPUs: utilisation swings, throughput stays flat however the layout
changes, and the network gets the blame (the input-bound case of Mohan et al. 2021, "Analyzing
and Mitigating Data Stalls in DNN Training", VLDB 2021).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass

from toolkit.config.schema import Config
from toolkit.plan.layout import Layout, resolve
from toolkit.plan.perf import estimate_step
from toolkit.train.data import build_datasets, micro_batches

HEADROOM = 2.0  # below this ratio a slower host or a busier node would starve the GPUs


@dataclass
class LoaderBench:
    supplied: float  # samples/s the loader made here
    consumed: float  # samples/s one data-parallel rank consumes at the planned step time
    workers: int
    samples: int
    seconds: float
    step_time: float
    per_step: int  # samples per step per data-parallel rank

    @property
    def ratio(self) -> float:
        return self.supplied / self.consumed

    def report(self) -> str:
        verdict = (
            f"the input pipeline keeps up ({self.ratio:,.1f}x what the GPUs consume)"
            if self.ratio >= HEADROOM
            else f"the input pipeline would starve the GPUs: it supplies {self.ratio:.2f}x what they consume "
            f"(want {HEADROOM:g}x or more); raise data.num_workers, move the data to faster storage, or "
            "measure again on a training node (this measures the machine it runs on)"
        )
        return (
            f"loader: {self.supplied:,.1f} samples/s on this machine ({self.samples} samples in {self.seconds:.2f} s, "
            f"{self.workers} worker(s))\n"
            f"GPUs: {self.consumed:,.1f} samples/s per data-parallel rank ({self.per_step} samples per step, planner "
            f"step {self.step_time:.3g} s)\n{verdict}"
        )


def bench_loader(cfg: Config, layout: Layout, steps: int = 20, progress: bool = True) -> LoaderBench:
    """Time `steps` steps of one rank's micro-batches (after one warm-up step) in this process."""
    import torch
    from tqdm import tqdm

    short = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, steps=steps + 1, tokens=None, eval_interval=None)
    )
    started_group = not torch.distributed.is_initialized()
    if started_group:  # the dataset builder synchronises ranks: a group of one
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        dataset = build_datasets(short, resolve(short)).train
        per_step = layout.grad_accum * layout.micro_batch
        batches = micro_batches(dataset, layout, dp_rank=0, device=torch.device("cpu"))
        list(itertools.islice(batches, layout.grad_accum))  # warm-up: workers started, caches filled
        start = time.perf_counter()
        for _ in tqdm(range(steps), desc="loading", unit="step", disable=not progress):
            list(itertools.islice(batches, layout.grad_accum))
        seconds = time.perf_counter() - start
        del batches  # shuts the loader's workers down
    finally:
        if started_group:
            torch.distributed.destroy_process_group()
    step_time = estimate_step(cfg, layout).step_time
    return LoaderBench(
        supplied=steps * per_step / seconds,
        consumed=per_step / step_time,
        workers=layout.loader_workers,
        samples=steps * per_step,
        seconds=seconds,
        step_time=step_time,
        per_step=per_step,
    )
