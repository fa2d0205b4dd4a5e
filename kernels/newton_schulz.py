"""Newton-Schulz orthogonalisation (Muon), torch reference.

`newton_schulz(X, steps)` approximates the nearest semi-orthogonal matrix U V^T of each
matrix in a batch (X = U S V^T), with Muon's quintic iteration (Jordan et al., 2024),
used by Mela's memory update (002_*.txt, eq. 10):

    X <- X / (||X||_F + 1e-7);  transpose if rows > cols
    repeat `steps` times:  A = X X^T;  B = b A + c A^2;  X = a X + B X
    with (a, b, c) = (3.4445, -4.7750, 2.0315)

Computed in float32 at least (float64 stays float64); the result has the input's dtype.
"""

from __future__ import annotations

import torch

MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(x: torch.Tensor, steps: int = 5, coefficients: tuple[float, float, float] = MUON_COEFFICIENTS) -> torch.Tensor:
    """x (..., rows, cols) -> same shape, singular values pushed towards 1."""
    a, b, c = coefficients
    work = x if x.dtype == torch.float64 else x.float()
    tall = work.shape[-2] > work.shape[-1]
    if tall:
        work = work.transpose(-1, -2)
    work = work / (torch.linalg.matrix_norm(work, keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = work @ work.transpose(-1, -2)
        work = a * work + (b * gram + c * gram @ gram) @ work
    if tall:
        work = work.transpose(-1, -2)
    return work.to(x.dtype)
