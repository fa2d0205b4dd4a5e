"""The plain torch references of the kernels (`kernels/__init__.py` dispatches between
them and the Triton kernels of `kernels/triton_kernels.py`; tests hold the two equal).

`newton_schulz_reference(X, steps)`: Newton-Schulz orthogonalisation (Muon), the nearest
semi-orthogonal matrix U V^T of each matrix in a batch (X = U S V^T) by Muon's quintic iteration (Jordan et al., 2024),
used by Mela's memory update ("Mela: Test-Time Memory Consolidation based on Transformation
Hypothesis", arXiv:2605.10537, eq. 10):

    X <- X / (||X||_F + 1e-7);  transpose if rows > cols
    repeat `steps` times:  A = X X^T;  B = b A + c A^2;  X = a X + B X
    with (a, b, c) = (3.4445, -4.7750, 2.0315)

`coefficients` is one (a, b, c) for every step or a schedule of one triple per step
(e.g. LaCT's five, `LACT_SCHEDULE`). Computed in float32 at least (float64 stays
float64); the result has the input's dtype.

`memory_update_reference`: the memory's per-chunk update step (Mela eq. 10-11; Titans eq. 2.39-2.40).

    S' = eta S - G
    M' = (1 - alpha) M + lr NewtonSchulz_k(S')      (k = 0: M' = (1 - alpha) M + lr S')

weight M, momentum S, gradient G: (..., rows, cols); eta, alpha: (...) one value per matrix;
lr (`step_scale`, a float) is Muon's learning rate on the orthogonalised step (1 = Mela's
eq. 10 as printed).
"""

from __future__ import annotations

import torch

MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
LACT_SCHEDULE = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                 (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))


def coefficient_schedule(coefficients, steps: int) -> tuple[tuple[float, float, float], ...]:
    """One (a, b, c) per step from a single triple or a schedule of `steps` triples."""
    if len(coefficients) == 3 and not isinstance(coefficients[0], (tuple, list)):
        return (tuple(coefficients),) * steps
    if len(coefficients) != steps:
        raise ValueError(f"newton_schulz: coefficient schedule has {len(coefficients)} triples for {steps} steps")
    return tuple(tuple(c) for c in coefficients)


def newton_schulz_reference(x: torch.Tensor, steps: int = 5, coefficients=MUON_COEFFICIENTS) -> torch.Tensor:
    """x (..., rows, cols) -> same shape, singular values pushed towards 1."""
    schedule = coefficient_schedule(coefficients, steps)
    work = x if x.dtype == torch.float64 else x.float()
    tall = work.shape[-2] > work.shape[-1]
    if tall:
        work = work.transpose(-1, -2)
    work = work / (torch.linalg.matrix_norm(work, keepdim=True) + 1e-7)
    for a, b, c in schedule:
        gram = work @ work.transpose(-1, -2)
        work = a * work + (b * gram + c * gram @ gram) @ work
    if tall:
        work = work.transpose(-1, -2)
    return work.to(x.dtype)




def memory_update_reference(weight: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, eta: torch.Tensor,
                            alpha: torch.Tensor, ns_steps: int, step_scale: float = 1.0,
                            coefficients=MUON_COEFFICIENTS):
    """Returns (new weight, new momentum)."""
    new_momentum = eta[..., None, None] * momentum - grad
    step = newton_schulz_reference(new_momentum, ns_steps, coefficients) if ns_steps else new_momentum
    return (1 - alpha)[..., None, None] * weight + step_scale * step, new_momentum


def silu_grad(x: torch.Tensor) -> torch.Tensor:
    """silu'(x) = s (1 + x (1 - s)), s = sigmoid(x)."""
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))
