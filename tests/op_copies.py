"""Copies a custom op's body runs besides its Triton kernels, for tests that hold a launch count
honest (torchtitan_ext/step_cost takes each op for one launch)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COPY_OPS = (torch.ops.aten.copy_, torch.ops.aten.clone, torch.ops.aten._to_copy)


class _Copies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in COPY_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def copies_run(fn, *args) -> tuple[object, int]:
    """fn(*args)'s result and the aten copies (copy_, clone, _to_copy) it dispatched."""
    with _Copies() as mode:
        result = fn(*args)
    return result, mode.count


def unrun_kernels(*names: str):
    """A stand-in for a module of Triton kernels `names`: `kernel[grid](...)` runs nothing."""
    unrun = type("Unrun", (), {"__getitem__": lambda self, grid: lambda *args, **kwargs: None})()
    return type("Kernels", (), dict.fromkeys(names, unrun))()
