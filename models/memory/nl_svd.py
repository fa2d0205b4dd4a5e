"""Non-Linear SVD (NL-SVD): compressing a two-layer MLP memory f(x) = sum_i act(<x, k_i>) v_i
to fewer slots (Locas, Lu et al. 2026, appendix A.1, Algorithm 1).

Keys K and values V are stored as rows, (n, d): slot i is (k_i, v_i), so f(x) = act(x K^T) V.
Each slot is weighted by s_i = ||k_i|| ||v_i|| (A.1.2); the new keys are the top principal
directions p_j of the weighted unit keys K_hat_i = s_i k_i / ||k_i|| (right singular vectors of
K_hat, i.e. eigenvectors of K_hat^T K_hat), and the new values are the original memory probed
along them, v~_j = f(p_j) (A.1.3), so the reduced memory agrees with the original on every p_j.

Sign convention (the paper is silent): eigenvectors are defined only up to sign and f(-p) !=
f(p) for ReLU, so each p_j is flipped to satisfy sum_i s_i <k_i / ||k_i||, p_j> >= 0, i.e. to
point along the weighted keys it summarises.

Everything is computed in float64 and returned in the input dtype.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Act = Callable[[torch.Tensor], torch.Tensor]


def mlp_memory(x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, act: Act = F.relu) -> torch.Tensor:
    """The memory's read f(x) = act(x K^T) V: x (..., d), keys (n, d), values (n, d) -> (..., d)."""
    return act(x @ keys.T) @ values


def _weighted_keys(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """K_hat (n, d), row i = s_i k_i / alpha_i with alpha_i = ||k_i||, s_i = alpha_i ||v_i|| (A.1.2).
    Slots with a zero key or a zero value get weight 0 (a zero row, no NaN)."""
    alpha = keys.norm(dim=-1, keepdim=True)
    s = alpha * values.norm(dim=-1, keepdim=True)
    return torch.where(s > 0, s * keys / alpha.clamp_min(torch.finfo(keys.dtype).tiny), 0.0)


def _orient(probes: torch.Tensor, weighted: torch.Tensor) -> torch.Tensor:
    """Flip each probe p (row of probes, (r, d)) so that sum_i <K_hat_i, p> >= 0 (module docstring)."""
    sign = torch.where(probes @ weighted.sum(0) < 0, -1.0, 1.0).to(probes.dtype)
    return probes * sign[:, None]


def nl_svd(keys: torch.Tensor, values: torch.Tensor, rank: int, act: Act = F.relu,
           eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress a memory of n slots to n' = min(rank, numerical rank of K_hat) <= min(rank, d)
    slots (appendix A.1.2-A.1.5, Algorithm 1), via the eigen-decomposition of the (d, d) Gram
    matrix K_hat^T K_hat rather than an SVD of the (n, d) K_hat.

    keys, values: (n, d). Returns new keys (n', d), the top eigenvectors as orthonormal rows
    (eigenvalues descending; those <= eps^2 * the largest dropped; signs as in the module
    docstring), and new values (n', d), row j = f(p_j) on the original memory (A.1.3). A memory
    whose slots all have zero weight gives two empty (0, d) tensors.
    """
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    k, v = keys.double(), values.double()
    weighted = _weighted_keys(k, v)
    eigvals, eigvecs = torch.linalg.eigh(weighted.T @ weighted)  # ascending
    eigvals, eigvecs = eigvals.flip(0)[:rank], eigvecs.flip(1)[:, :rank]
    keep = eigvals > eps ** 2 * eigvals[:1].clamp_min(0)
    probes = _orient(eigvecs[:, keep].T, weighted)
    return probes.to(keys.dtype), mlp_memory(probes, k, v, act).to(values.dtype)


def compress_if_full(keys: torch.Tensor, values: torch.Tensor, capacity: int,
                     act: Act = F.relu) -> tuple[torch.Tensor, torch.Tensor]:
    """The expansion-compression cycle (A.1.6): a memory (n, d) holding n >= capacity slots is
    compressed by `nl_svd` to at most capacity // 2; a smaller one is returned unchanged."""
    if keys.shape[0] >= capacity:
        return nl_svd(keys, values, capacity // 2, act)
    return keys, values
