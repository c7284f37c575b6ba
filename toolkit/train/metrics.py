"""Training metrics on rank 0: console/progress bar, metrics.jsonl and the trackers of train.loggers
(toolkit.train.trackers: TensorBoard, Weights & Biases, MLflow).

Throughput uses the planner's FLOP count (toolkit.plan.flops), so measured TFLOP/s and MFU are
comparable with `parakit plan`; the planner's predicted step time and memory sit beside the
measured ones.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

from toolkit.config.schema import Config
from toolkit.formats.atomic import write_atomic
from toolkit.plan.flops import step_flops
from toolkit.plan.kernels import mfu_peak_flops
from toolkit.plan.layout import Layout
from toolkit.plan.memory import GIB, peak_memory
from toolkit.plan.perf import estimate_step
from toolkit.train.checkpoint import Resume
from toolkit.train.distributed import local_restarts
from toolkit.train.probe import stage_times
from toolkit.train.trackers import Trackers, tracked


def peak_memory_gib() -> dict:
    """This process's peak memory: on a GPU what tensors held (max_memory_allocated) and what the
    caching allocator held (max_memory_reserved); on CPU the resident set size."""
    if torch.cuda.is_available():
        return {
            "memory_gib": torch.cuda.max_memory_allocated() / GIB,
            "memory_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        }
    return {"memory_gib": psutil.Process().memory_info().rss / GIB}


def _max_of(ranks: list[dict], key: str) -> float | None:
    values = [r[key] for r in ranks if r.get(key) is not None]
    return max(values) if values else None


class Metrics:
    def __init__(
        self,
        cfg: Config,
        layout: Layout,
        run_dir: Path,
        enabled: bool,
        resume: Resume | None = None,
        kernels: dict | None = None,
    ):
        self.cfg, self.layout, self.enabled = cfg, layout, enabled
        self.kernels = kernels or {}
        self.resume = resume or Resume()
        resume_step = self.resume.step
        flops = step_flops(
            cfg.model, layout.seq_length, layout.global_batch, cfg.recompute.granularity, layout.padded_vocab_size
        )
        self.model_flops_per_step = flops.model
        self.tokens_per_step = flops.tokens
        self.peak = mfu_peak_flops(cfg)
        self.predicted_step = estimate_step(cfg, layout).step_time
        # Like with like: allocated tensors with the planner's tensors, the allocator's reservation
        # with its tensors plus fragmentation (the CUDA context and NCCL are outside both).
        memory = peak_memory(cfg, layout)
        self.predicted_memory, self.predicted_reserved = memory.tensors / GIB, memory.reserved / GIB
        self.predicted_total = memory.total / GIB
        self.history: list[dict] = []  # one record per step
        self.evaluations: list[dict] = []  # {"step", "val_loss", "val_ppl"} per evaluation
        self._jsonl = self._trackers = self._bar = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            log = run_dir / "metrics.jsonl"
            if log.exists():  # a resumed run: keep the steps up to the checkpoint, redo the rest
                kept = [r for r in map(json.loads, log.read_text().splitlines()) if r["step"] <= resume_step]
                write_atomic(log, "".join(json.dumps(r) + "\n" for r in kept))
                self.history = [r for r in kept if "loss" in r]
                self.evaluations = [r for r in kept if "val_loss" in r]
            self._jsonl = open(log, "a")
            self._trackers = Trackers(cfg, run_dir, resume_step)
            if sys.stderr.isatty():
                from tqdm import tqdm

                self._bar = tqdm(total=layout.last_step, desc="training", unit="step")
            if self.kernels:
                print("kernels: " + ", ".join(f"{k} {v}" for k, v in self.kernels.items()), flush=True)
            print(
                f"planner: predicted step {self.predicted_step:.3g} s, peak memory {self.predicted_total:.2f} GiB "
                f"per rank ({self.predicted_memory:.2f} GiB of tensors)",
                flush=True,
            )
        self._last = time.perf_counter()

    def step(
        self, step: int, loss: float, lr: float, grad_norm: float | None, skipped: bool, extra: dict | None = None
    ) -> None:
        """Record a step; `extra`: other losses it reports (e.g. moe_aux_loss), logged with it."""
        extra = extra or {}
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "skipped": skipped,
            "step_time_s": seconds,
            "tokens_per_s": self.tokens_per_step / seconds,
            "tflops_per_gpu": self.model_flops_per_step / seconds / self.layout.world_size / 1e12,
            "mfu": self.model_flops_per_step / seconds / self.layout.world_size / self.peak,
            **peak_memory_gib(),
            "predicted_step_time_s": self.predicted_step,
            "predicted_memory_gib": self.predicted_memory,
            **extra,
        }
        if "memory_reserved_gib" in record:  # GPUs: the allocator's reservation beside the planner's
            record["predicted_reserved_gib"] = self.predicted_reserved
        self.history.append(record)
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._trackers.log(tracked(record, tuple(extra)), step)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        if step % self.cfg.train.log_interval == 0 or step == self.layout.last_step:
            line = (
                f"step {step:>5}/{self.layout.steps} | loss {loss:.4f} | "
                + "".join(
                    f"{name.removeprefix('moe_').replace('_', ' ')} {value:.4g} | " for name, value in extra.items()
                )
                + f"lr {lr:.3e} | grad norm "
                f"{grad_norm if grad_norm is None else f'{grad_norm:.3f}'} | {record['step_time_s']:.2f} s "
                f"(planner {self.predicted_step:.2g} s) | {record['tokens_per_s']:,.0f} tok/s | "
                f"{record['tflops_per_gpu']:.3g} TFLOP/s/GPU | MFU {record['mfu']:.1%} | "
                + self._memory_text(record)
                + self._eta(step)
            )
            (self._bar.write if self._bar is not None else print)(line)
            sys.stdout.flush()

    def _eta(self, step: int) -> str:
        """The time the remaining steps take at the median of the last ten steps' times."""
        left = self.layout.last_step - step
        if not left:
            return ""
        recent = statistics.median(r["step_time_s"] for r in self.history[-10:])
        return f" | ETA {datetime.timedelta(seconds=round(left * recent))}"

    def _memory_text(self, record: dict) -> str:
        if "memory_reserved_gib" in record:
            return (
                f"GPU peak {record['memory_gib']:.2f} GiB allocated (planner {self.predicted_memory:.2f}), "
                f"{record['memory_reserved_gib']:.2f} GiB reserved (planner {self.predicted_reserved:.2f})"
            )
        return f"RSS {record['memory_gib']:.2f} GiB (planner {self.predicted_memory:.2f} GiB of tensors)"

    def slow_ranks(self, step: int, window: dict) -> None:
        """Ranks slower than their peers over a window of steps (toolkit.train.stragglers): a
        metrics.jsonl record and a console line each."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, **window}) + "\n")
        self._jsonl.flush()
        first, last = window["steps"]
        for r in window["slow_ranks"]:
            line = (
                f"step {step:>5}/{self.layout.steps} | slow rank {r['rank']} (host {r['host']}, local rank "
                f"{r['local_rank']}, pipeline stage {r['stage']}): {r['compute_s']:.3g} s of compute per step over "
                f"steps {first}-{last}, {r['over']:.0%} over its stage's other ranks (median {r['median_s']:.3g} s)"
            )
            (self._bar.write if self._bar is not None else print)(line)
        sys.stdout.flush()

    def evaluated(self, step: int, val_loss: float) -> None:
        """A validation loss: its own metrics.jsonl record, TensorBoard val/loss, a console line.
        The time evaluation took is not charged to the next step."""
        record = {"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700))}
        self.evaluations.append(record)
        if self.enabled:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
            self._trackers.log(tracked(record), step)
            line = f"step {step:>5}/{self.layout.steps} | validation loss {val_loss:.4f} | ppl {record['val_ppl']:.4g}"
            (self._bar.write if self._bar is not None else print)(line)
            sys.stdout.flush()
        self._last = time.perf_counter()

    def abandon(self) -> None:
        """A run that raised: the trackers' runs end marked failed (MLflow's would stay RUNNING), and a
        tracker that fails to close does not hide the error."""
        if self._trackers is not None:
            with contextlib.suppress(Exception):
                self._trackers.close(complete=False)
            self._trackers = None

    def close(self, run_dir: Path, complete: bool = True, ranks: list[dict] | None = None) -> list[float]:
        """Flush everything; result.json only for a run that completed (it marks success), with
        every rank's measurements (`ranks`, toolkit.train.probe.gather_ranks). Returns the loss
        curve (every rank keeps it)."""
        losses = [r["loss"] for r in self.history]
        if not self.enabled:
            return losses
        if self._bar is not None:
            self._bar.close()
        self._jsonl.close()
        self._trackers.close(complete)
        self._trackers = None
        if not complete:
            return losses
        summary = {
            "steps": len(self.history),
            "losses": losses,
            "final_loss": self.history[-1]["loss"] if self.history else None,
            "val_losses": {r["step"]: r["val_loss"] for r in self.evaluations},
            "final_val_loss": self.evaluations[-1]["val_loss"] if self.evaluations else None,
            "mean_tokens_per_s": sum(r["tokens_per_s"] for r in self.history[1:]) / max(1, len(self.history) - 1),
            # which attempt of a torchrun-restarted job finished, and where it started from
            "restarts": local_restarts(),
            "kernels": self.kernels,
            **self.resume.record(),
        }
        if ranks:
            summary |= {
                "ranks": ranks,
                "restarts": max(r["restarts"] for r in ranks),  # the node whose agent restarted most
                "stage_times_s": stage_times(ranks, self.layout.pp),
                "tensor_peak_gib": _max_of(ranks, "tensor_peak_gib"),
                "peak_rss_gib": _max_of(ranks, "peak_rss_gib"),
            }
            if self.layout.pp > 1:  # the guide: judge a pipeline by how even its stages are
                times = summary["stage_times_s"]
                listing = ", ".join(f"{t:.3g}" for t in times)
                print(
                    f"pipeline stages compute {listing} s per step; the slowest is "
                    f"{max(times) / max(min(times), 1e-9):.2g}x the fastest",
                    flush=True,
                )
        write_atomic(run_dir / "result.json", json.dumps(summary, indent=2))  # last: a finished run has it
        return losses
