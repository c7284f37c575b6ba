"""Preemption: stop at a step boundary with a published checkpoint when asked, so that the job
can be requeued and resume exactly (toolkit.train.checkpoint).

Asked by SIGUSR1 to a rank, or by the file RUN_DIR/preempt.request. Slurm sends the signal some
minutes before the time limit (launch.sh's `#SBATCH --signal=B:USR1@S`) to the batch shell only:
torchrun, which does not handle SIGUSR1, would die of it; the batch shell writes the request file
instead, and requeues the job once the ranks have stopped. Every rank must stop after the same
step, so each step ends with one all_reduce (MAX) of the ranks' "asked" flags, as Megatron-LM's
DistributedSignalHandler all-gathers its ranks' signals every iteration.
"""

from __future__ import annotations

import signal
from pathlib import Path

import torch

from toolkit.emit.launch import REQUEST, STOPPED  # the file names launch.sh's trap and requeue use


class Preemption:
    def __init__(self, run_dir: Path):
        self.request, self.stopped_file = run_dir / REQUEST, run_dir / STOPPED
        self.signalled = False
        self.device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"  # NCCL: device tensors
        if torch.distributed.get_rank() == 0:
            self.stopped_file.unlink(missing_ok=True)  # a requeued job starts unmarked
        signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def requested(self) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it after each step)."""
        asked = torch.tensor([int(self.signalled or self.request.exists())], device=self.device)
        torch.distributed.all_reduce(asked, op=torch.distributed.ReduceOp.MAX)
        return bool(asked.item())

    def stopped(self, step: int, root: Path) -> None:
        """Rank 0, after the checkpoint of `step` is published: mark the run as preempted there."""
        if torch.distributed.get_rank() == 0:
            self.request.unlink(missing_ok=True)
            self.stopped_file.write_text(f"{step}\n")
            print(
                f"preempted: stopped after step {step} with its checkpoint in {root}; resume continues from it",
                flush=True,
            )

    def finished(self) -> None:
        """The run reached its last step: a request that came too late to matter is spent."""
        if torch.distributed.get_rank() == 0:
            self.request.unlink(missing_ok=True)
