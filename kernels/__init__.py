"""Triton kernels, each with a plain torch reference beside it, behind one entry point per op.

`newton_schulz(x, steps, backend)`: backend "auto" runs the Triton kernel on CUDA tensors
it supports and the torch reference otherwise; "triton" / "torch" force one (tests force
"triton" on CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from kernels.newton_schulz import MUON_COEFFICIENTS
from kernels.newton_schulz import newton_schulz as newton_schulz_reference

BACKENDS = ("auto", "triton", "torch")


def _triton_supports(x: torch.Tensor) -> bool:
    from kernels.newton_schulz_triton import MAX_COLS, MAX_ROWS

    small, large = sorted(x.shape[-2:])
    return x.dtype in (torch.float32, torch.bfloat16) and small <= MAX_ROWS and large <= MAX_COLS


def newton_schulz(x: torch.Tensor, steps: int = 5, backend: str = "auto", coefficients=MUON_COEFFICIENTS) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration on each matrix of x (..., rows, cols)."""
    if backend not in BACKENDS:
        raise ValueError(f"newton_schulz: backend '{backend}' unknown: choose one of {BACKENDS}")
    if backend == "triton" or (backend == "auto" and x.is_cuda and _triton_supports(x)):
        from kernels.newton_schulz_triton import newton_schulz_triton

        return newton_schulz_triton(x.contiguous(), steps, coefficients)
    return newton_schulz_reference(x, steps, coefficients)
