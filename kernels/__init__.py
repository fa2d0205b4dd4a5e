"""Triton kernels, each with a plain torch reference beside it, behind one entry point per op.

- `newton_schulz(x, steps, backend)`: Muon's Newton-Schulz iteration.
- `memory_update(weight, momentum, grad, eta, alpha, ns_steps, backend, step_scale)`: the
  memory's per-chunk step S' = eta S - G, M' = (1 - alpha) M + step_scale NS(S'), fused in one kernel.
backend "auto" runs a Triton kernel on CUDA tensors (fp32, bf16) and the eager torch
reference otherwise: the per-matrix kernel when the matrices fit one program (up to
128 x 512, either orientation), else for `newton_schulz` the blocked kernel (any size,
upper-triangular Gram blocks; `memory_update` falls back to torch). "triton" (per matrix),
"triton_blocked" (blocked, `newton_schulz` only), "torch" (eager reference) and "compiled"
(the reference through torch.compile, compiled once per shape) force one. Tests force the
Triton backends on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
import importlib

import torch

from kernels.reference import MUON_COEFFICIENTS, memory_update_reference, newton_schulz_reference

BACKENDS = ("auto", "triton", "triton_blocked", "torch", "compiled")  # newton_schulz
MEMORY_UPDATE_BACKENDS = tuple(b for b in BACKENDS if b != "triton_blocked")


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


@functools.cache
def _triton_module():
    """The Triton kernels module, or None where it cannot be imported: triton is not
    installed, or this is a Hugging Face export (it ships the torch paths only)."""
    try:
        return importlib.import_module("kernels.triton_kernels")
    except ImportError:
        return None


def _triton(op: str):
    module = _triton_module()
    if module is None:
        raise RuntimeError(f"{op}: the Triton kernels cannot be imported here (no triton, or an exported model): "
                           "use backend='torch'")
    return module


def _fits_tile(x: torch.Tensor) -> bool:
    small, large = sorted(x.shape[-2:])
    return small <= _triton_module().MAX_ROWS and large <= _triton_module().MAX_COLS


def _resolve(op: str, backend: str, x: torch.Tensor, choices: tuple[str, ...]) -> str:
    """The backend that runs `op` on x (..., rows, cols): `backend` itself unless it is "auto"."""
    if backend not in choices:
        raise ValueError(f"{op}: backend '{backend}' unknown: choose one of {choices}")
    if backend != "auto":
        return backend
    if not x.is_cuda or x.dtype not in (torch.float32, torch.bfloat16) or _triton_module() is None:
        return "torch"
    if _fits_tile(x):
        return "triton"
    return "triton_blocked" if "triton_blocked" in choices else "torch"


def newton_schulz(x: torch.Tensor, steps: int = 5, backend: str = "auto", coefficients=MUON_COEFFICIENTS) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration on each matrix of x (..., rows, cols)."""
    backend = _resolve("newton_schulz", backend, x, BACKENDS)
    if backend == "triton":
        return _triton("newton_schulz").newton_schulz_triton(x.contiguous(), steps, coefficients)
    if backend == "triton_blocked":
        return _triton("newton_schulz").newton_schulz_blocked(x.contiguous(), steps, coefficients)
    reference = _compiled(newton_schulz_reference) if backend == "compiled" else newton_schulz_reference
    return reference(x, steps, coefficients)


def memory_update(weight, momentum, grad, eta, alpha, ns_steps: int, backend: str = "auto", step_scale: float = 1.0):
    """(new weight, new momentum) of one chunk step; see kernels/reference.py."""
    backend = _resolve("memory_update", backend, weight, MEMORY_UPDATE_BACKENDS)
    if backend == "triton":
        return _triton("memory_update").memory_update_triton(weight.contiguous(), momentum.contiguous(),
                                                              grad.contiguous(), eta, alpha, ns_steps, step_scale)
    reference = _compiled(memory_update_reference) if backend == "compiled" else memory_update_reference
    return reference(weight, momentum, grad, eta, alpha, ns_steps, step_scale)
