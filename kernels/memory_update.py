"""The memory's per-chunk update step (Mela eq. 10-11; Titans eq. 2.39-2.40), torch reference.

    S' = eta S - G
    M' = (1 - alpha) M + lr NewtonSchulz_k(S')      (k = 0: M' = (1 - alpha) M + lr S')

weight M, momentum S, gradient G: (..., rows, cols); eta, alpha: (...) one value per matrix;
lr (`step_scale`, a float) is Muon's learning rate on the orthogonalised step (1 = Mela's
eq. 10 as printed).
"""

from __future__ import annotations

import torch

from kernels.newton_schulz import MUON_COEFFICIENTS, newton_schulz


def memory_update_reference(weight: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, eta: torch.Tensor,
                            alpha: torch.Tensor, ns_steps: int, step_scale: float = 1.0,
                            coefficients=MUON_COEFFICIENTS):
    """Returns (new weight, new momentum)."""
    new_momentum = eta[..., None, None] * momentum - grad
    step = newton_schulz(new_momentum, ns_steps, coefficients) if ns_steps else new_momentum
    return (1 - alpha)[..., None, None] * weight + step_scale * step, new_momentum
