"""Triton kernels, each with a plain torch reference beside it, behind one entry point per op.

- `newton_schulz(x, steps, backend)`: Muon's Newton-Schulz iteration.
- `memory_update(weight, momentum, grad, eta, alpha, ns_steps, backend)`: the memory's
  per-chunk step S' = eta S - G, M' = (1 - alpha) M + NS(S'), fused in one kernel.
backend "auto" runs the Triton kernel on CUDA tensors it supports and the eager torch
reference otherwise; "triton", "torch" (eager reference) and "compiled" (the reference
through torch.compile, compiled once per shape) force one. Tests force "triton" on CPU
under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools

import torch

from kernels.memory_update import memory_update_reference
from kernels.newton_schulz import MUON_COEFFICIENTS
from kernels.newton_schulz import newton_schulz as newton_schulz_reference

BACKENDS = ("auto", "triton", "torch", "compiled")


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def _triton_supports(x: torch.Tensor) -> bool:
    from kernels.triton_kernels import MAX_COLS, MAX_ROWS

    small, large = sorted(x.shape[-2:])
    return x.dtype in (torch.float32, torch.bfloat16) and small <= MAX_ROWS and large <= MAX_COLS


def _use_triton(op: str, backend: str, x: torch.Tensor) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend '{backend}' unknown: choose one of {BACKENDS}")
    return backend == "triton" or (backend == "auto" and x.is_cuda and _triton_supports(x))


def newton_schulz(x: torch.Tensor, steps: int = 5, backend: str = "auto", coefficients=MUON_COEFFICIENTS) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration on each matrix of x (..., rows, cols)."""
    if _use_triton("newton_schulz", backend, x):
        from kernels.triton_kernels import newton_schulz_triton

        return newton_schulz_triton(x.contiguous(), steps, coefficients)
    reference = _compiled(newton_schulz_reference) if backend == "compiled" else newton_schulz_reference
    return reference(x, steps, coefficients)


def memory_update(weight, momentum, grad, eta, alpha, ns_steps: int, backend: str = "auto"):
    """(new weight, new momentum) of one chunk step; see kernels/memory_update.py."""
    if _use_triton("memory_update", backend, weight):
        from kernels.triton_kernels import memory_update_triton

        return memory_update_triton(weight.contiguous(), momentum.contiguous(), grad.contiguous(), eta, alpha, ns_steps)
    reference = _compiled(memory_update_reference) if backend == "compiled" else memory_update_reference
    return reference(weight, momentum, grad, eta, alpha, ns_steps)
