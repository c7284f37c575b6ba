"""Train the tiny model one rank at BACKEND with 2 and then 4 layers (bf16, 4 micro-batches a step)
and count the operations the PyTorch dispatcher runs inside the forward/backward spans the trainer
times and outside them, step by step; print as JSON, per depth, the median per micro-batch and per
step over the steps after the first two (setup and the optimizer's first step allocate).

    python count_dispatches.py BACKEND RUN_DIR
"""

import contextlib
import json
import statistics
import sys

from torch.utils._python_dispatch import TorchDispatchMode

from toolkit.train import probe

MICROBATCHES = 4
state = {"inside": 0, "outside": 0, "depth": 0, "marks": []}


class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        state["inside" if state["depth"] else "outside"] += 1
        return func(*args, **(kwargs or {}))


def _spanned(method, change):
    def wrapped(self, *args, **kwargs):
        state["depth"] += change if self.owner else 0
        return method(self, *args, **kwargs)

    return wrapped


probe._Span.start = _spanned(probe._Span.start, 1)
probe._Span.stop = _spanned(probe._Span.stop, -1)
_timing = probe.ComputeTimers.timing


@contextlib.contextmanager
def _timed(self):
    state["depth"] += 1
    try:
        with _timing(self):
            yield
    finally:
        state["depth"] -= 1


probe.ComputeTimers.timing = _timed
_reset = probe.ComputeTimers.reset


def _marked(self):
    state["marks"].append((state["inside"], state["outside"]))  # once per step, before its passes
    _reset(self)


probe.ComputeTimers.reset = _marked


def count(backend: str, layers: int, run_dir: str) -> dict:
    from toolkit import cli

    state["marks"] = []
    if backend == "deepspeed":  # DeepSpeed keeps the previous run's process groups
        import deepspeed.utils.groups as groups

        for name, value in list(vars(groups).items()):
            if name.startswith("_") and name.endswith("_GROUP"):
                setattr(groups, name, {} if isinstance(value, dict) else None)
    overrides = [
        "model=tiny", "cluster=cpu", f"backend={backend}", "zero=1", "cluster.gpus_per_node=1",
        f"model.num_layers={layers}", "train.steps=6", f"train.global_batch={MICROBATCHES}", "train.micro_batch=1",
        "data=synthetic", "precision=bf16", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    with Count():
        try:
            cli.main(["train", *overrides])
        except SystemExit as stop:
            if stop.code:
                raise
    marks = state["marks"]
    steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks[2:], marks[3:])]
    return {
        "per_microbatch": statistics.median(s[0] for s in steps) / MICROBATCHES,
        "per_step": statistics.median(s[1] for s in steps),
    }


backend, run_dir = sys.argv[1:3]
print(json.dumps({layers: count(backend, layers, f"{run_dir}/layers{layers}") for layers in (2, 4)}))
