"""transformer_debug with faults injected, for tests/test_faults.py. `--module fault_configs`
imports this module on every rank and calls the config function there, which installs the
fault in that process:
- `transformer_debug_disk_fills`: DCP's file writer writes half a shard and raises ENOSPC on
  its second save (the disk-full stop);
- `transformer_debug_nan_once`: on rank 0 only, the embedding output turns NaN at step 3 (a
  non-finite loss) and its gradient turns NaN at step 5 (finite loss, non-finite gradients);
- `transformer_debug_nan_from_step_3`: on every rank, the embedding output is NaN from step 3
  on (the stop after `--training.max_nonfinite_skips` skips).
Steps are counted as training forwards of the embedding: one micro-batch a step, no resume."""

import errno
import os

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from train_configs.transformer import transformer_debug

_write_data = FileSystemWriter.write_data
_saves = {"count": 0}


def _write_data_until_the_disk_fills(self, plan, planner):
    _saves["count"] += 1
    if _saves["count"] < 2:
        return _write_data(self, plan, planner)
    shard = self.fs.concat_path(self.path, "__partial_0.distcp")
    with self.fs.create_stream(shard, "wb") as stream:
        stream.write(b"\0" * 4096)
    raise OSError(errno.ENOSPC, "No space left on device")


def transformer_debug_disk_fills():
    FileSystemWriter.write_data = _write_data_until_the_disk_fills
    return transformer_debug()


_hooks = []


def _poison_embedding(loss_steps, grad_steps) -> None:
    """A global forward hook: the embedding's output is NaN on training steps in `loss_steps`
    (a predicate), its gradient NaN on those in `grad_steps`. Installed once per process (the
    entry point parses the config more than once)."""
    if _hooks:
        return
    forwards = {"count": 0}

    def hook(module, args, output):
        if not isinstance(module, torch.nn.Embedding) or not module.training:
            return output
        forwards["count"] += 1
        step = forwards["count"]
        if loss_steps(step):
            return output * float("nan")
        if grad_steps(step):
            output.register_hook(lambda grad: grad * float("nan"))
        return output

    _hooks.append(torch.nn.modules.module.register_module_forward_hook(hook))


def transformer_debug_nan_once():
    rank0 = os.environ.get("RANK", "0") == "0"
    _poison_embedding(lambda step: rank0 and step == 3, lambda step: rank0 and step == 5)
    return transformer_debug()


def transformer_debug_nan_from_step_3():
    _poison_embedding(lambda step: step >= 3, lambda step: False)
    return transformer_debug()
