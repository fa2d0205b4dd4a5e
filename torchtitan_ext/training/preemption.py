"""Preemption: SLURM (and torchrun's agent) send SIGTERM, then SIGKILL after a grace period.

On SIGTERM a rank only notes it (`install`). Before each step the trainer asks `agreed()`:
the ranks all-reduce the note (one scalar MAX per step), so every rank stops after the same
finished step, even when the signal reached them during different steps. The trainer then
writes a full, resumable checkpoint of that step (unless its interval just did) and ends
training; the entry point exits with `EXIT_PREEMPTED`, rank 0 leaves the file the launcher
names in PREEMPTED_MARKER (torchrun's own exit code does not carry the ranks'), and rerunning
the same command resumes from that step exactly (data order and optimizer state are in the
checkpoint).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 75  # EX_TEMPFAIL of sysexits.h: the run stopped on purpose and resumes when rerun
_requested = {"signal": False, "stopped_at": None}


def _note(signum, frame) -> None:
    _requested["signal"] = True


def install() -> None:
    """Note SIGTERM instead of dying at once (call once per rank, before training)."""
    signal.signal(signal.SIGTERM, _note)


def agreed() -> bool:
    """Whether any rank has received SIGTERM (a collective: every rank must call it)."""
    flag = torch.tensor([float(_requested["signal"])])
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def mark_stopped(step: int) -> None:
    _requested["stopped_at"] = step


def stopped_at() -> int | None:
    """The step training stopped after on SIGTERM, or None when it was not preempted."""
    return _requested["stopped_at"]


def report(rank: int) -> None:
    """Rank 0: one console line, and the launcher's marker file (PREEMPTED_MARKER)."""
    if rank != 0:
        return
    print(f"train: preempted (SIGTERM) after step {stopped_at()}, its checkpoint written: rerun the same command "
          "to resume", flush=True)
    if os.environ.get("PREEMPTED_MARKER"):
        Path(os.environ["PREEMPTED_MARKER"]).write_text(f"{stopped_at()}\n")
