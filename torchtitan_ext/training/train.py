"""Training entry point: `python -m torchtitan_ext.training.train --module M --config F [--section.key value ...]`.

Runs torchtitan 0.3.0's own `torchtitan.train.main` after
1. the environment checked (torch >= 2.11, every package the run imports: one line naming what
   is missing) and the CPU support (only without an accelerator); the torch-version mends
   (`torch_compat`) are in place from the import of `torchtitan_ext`, and torchtitan's
   CUDA-graph step is turned off where this torch cannot replay flex-attention masks,
2. the command line parsed (`cli.py`) and checked (`preflight.py`), so that bad input ends
   with one line naming the problem and the fix, and exit code 2, before any work,
3. fitting the local batch to the data-parallel degree (`preflight.fitted_local_batch`:
   the global batch is fixed, gradient accumulation makes up the rest),
4. choosing the step to resume from: the newest checkpoint whose files are whole and hold
   this model (`checkpoints.resume_step`); a damaged newer step (a node that died mid-write:
   a shard missing or truncated, a `.metadata` that does not parse, another model's shards)
   is skipped with one warning line naming it and why; none whole: one line, exit 2.
On SIGTERM (preemption) every rank finishes its step, a checkpoint of it is written and the
run exits with code 75 (`preemption.py`); rerunning the command resumes there. A save that
runs out of space stops with one line naming the folder and the bytes a checkpoint takes,
exit code 4; the step it was writing has no `.metadata`, so the rerun resumes from the one before.
A step whose loss or gradients are not finite is skipped (not applied, counted, one warning
line, no interval checkpoint of it; `trainer.MemoryTrainer`); more than
`--training.max_nonfinite_skips` (default 3) in a row stop training with one line and exit
code 3, the newest checkpoint being of the last applied step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from torchtitan_ext.training import cpu, preemption
from torchtitan_ext.errors import UserError

EXIT_USER_ERROR = 2
EXIT_NON_FINITE = 3
EXIT_DISK_FULL = 4


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _fail(message: str, code: int) -> None:
    """Rank 0: the one-line message, and the exit code in the launcher's EXIT_CODE_FILE
    (torchrun's own exit code does not carry the ranks'); every rank exits with `code`."""
    if _rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
        if os.environ.get("EXIT_CODE_FILE"):
            Path(os.environ["EXIT_CODE_FILE"]).write_text(f"{code}\n")
    sys.exit(code)


def _resume_args(config) -> list[str]:
    """["--checkpoint.load_step", N] when newer checkpoint steps are damaged and step N is the
    newest whole one (one warning line each, rank 0), else []."""
    from torchtitan_ext.training.checkpoints import resume_plan

    step, damaged = resume_plan(config)
    for reason in damaged:
        if _rank() == 0:
            print(f"warning: checkpoint {reason}; resuming from step-{step}", file=sys.stderr, flush=True)
    return ["--checkpoint.load_step", str(step)] if damaged else []


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    from torchtitan_ext.training import cli, preflight

    explicit = cli.option_value(argv, "--training.local_batch_size") is not None
    try:
        preflight.check_environment()  # before torchtitan is imported (cpu.apply, parse): a missing package is one line
        cpu.apply()
        config = cli.parse(argv)
        preflight.check(config, explicit_local_batch=explicit)
        local_batch = preflight.fitted_local_batch(config, preflight.world_size(), explicit)
    except UserError as e:
        _fail(str(e), EXIT_USER_ERROR)
    if local_batch != config.training.local_batch_size:
        if _rank() == 0:
            print(f"train: local batch {config.training.local_batch_size} -> {local_batch} sequences to fit the global "
                  f"batch of {config.training.global_batch_size} on {preflight.world_size()} ranks", flush=True)
        argv = [*argv, "--training.local_batch_size", str(local_batch)]
    import torch

    from kernels.ptxas import arch_of, use_fixed_ptxas
    from torchtitan_ext import torch_compat

    if torch.cuda.is_available() and (fixed := use_fixed_ptxas(arch_of(torch.device("cuda")))) and _rank() == 0:
        print(f"train: Triton assembles Hopper kernels with {fixed} (ptxas >= 13.3; kernels/ptxas.py)", flush=True)

    if graph_args := torch_compat.cuda_graph_args(config):
        if _rank() == 0:
            print(f"train: torchtitan's CUDA-graph step is off: torch {torch.__version__} cannot replay "
                  "flex-attention masks across steps (torch >= 2.13 can)", flush=True)
        argv = [*argv, *graph_args]
    try:
        argv = [*argv, *_resume_args(config)]
    except UserError as e:
        _fail(str(e), EXIT_USER_ERROR)

    import torchtitan.train

    sys.argv = [sys.argv[0], *argv]
    preemption.install()
    try:
        torchtitan.train.main()
    except UserError as e:
        _fail(str(e), EXIT_USER_ERROR)
    except RuntimeError as e:
        from torchtitan_ext.training.trainer import NonFiniteSteps

        if not isinstance(e, NonFiniteSteps):
            raise
        _fail(f"{e}. Checkpoints written before this step are intact; lower --optimizer.lr or check the data, "
              "then resume.", EXIT_NON_FINITE)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        from torchtitan_ext.training.checkpoints import disk_full_message, is_disk_full

        if not is_disk_full(e):
            raise
        _fail(disk_full_message(config), EXIT_DISK_FULL)
    if preemption.stopped_at() is not None:
        preemption.report(_rank())
        sys.exit(preemption.EXIT_PREEMPTED)


if __name__ == "__main__":
    main()
