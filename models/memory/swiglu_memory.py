"""A SwiGLU fast-weight memory written by one momentum step per segment (MoNe's memory).

MoNe ("Modular Neural Memory", paper 004), eq. 3 and 7-8 with its appendix A.2, following
LaCT (Zhang et al.): per head, fast weights W = {W_in, W_gate, W_out}

    M(x; W) = (SiLU(x W_in) * (x W_gate)) W_out                       (eq. 3, row-vector form)
    l_j(W)  = -v_j . M(k_j; W)                                        (eq. 7: negative dot product)
    G_s     = sum_j (lr_j / T) grad_W l_j(W_{s-1})                     (segment average, per-token lr)
    mu_s    = beta_s mu_{s-1} + G_s,   W_s = W_{s-1} - mu_s           (eq. 8 with momentum)
    W_s     <- each column of W_s rescaled to that column's norm in W_0 (channel-wise L2 renorm)

Shapes: weights (B, H, in, hidden), (B, H, in, hidden), (B, H, hidden, out); x, k (B, H, N,
in); v (B, H, N, out); lr (B, H, N); beta (B, H). The gradient is the explicit backward of
eq. 3 (no autograd inside the inner loop, as `models/memory/neural_memory.py`), and the
momentum step runs through `kernels.memory_update` (S = -mu: S' = beta S - G, W' = W + S',
alpha = 0, no Newton-Schulz), the memory's shared kernel. All of it is differentiable, so the
outer loss trains what produced k, v, lr and beta, and W_0.

Choice where the paper is silent: a "channel" is a column (one output unit of x @ W, the
norm taken over the input dimension), and the target norms are W_0's (LaCT keeps the
initial weights' norms), so the memory's scale cannot grow however many segments it reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import memory_update as kernel_memory_update
from kernels.reference import silu_grad

RENORM_FLOOR = 1e-12  # a zero column stays zero


def swiglu_forward(weights, x: torch.Tensor):
    """M(x) (eq. 3) for x (B, H, N, in) -> (B, H, N, out), and what the backward needs."""
    w_in, w_gate, w_out = weights
    pre, gate = x @ w_in, x @ w_gate
    return (F.silu(pre) * gate) @ w_out, (x, pre, gate)


def swiglu_grads(weights, saved, delta: torch.Tensor, token_weights: torch.Tensor):
    """sum_j token_weights_j dl_j/dW for the three fast weights, given delta_j = dl_j/dM(x_j)
    (B, H, N, out) and `saved` from `swiglu_forward(weights, x)`; token_weights (B, H, N)."""
    _, _, w_out = weights
    x, pre, gate = saved
    weighted = delta * token_weights[..., None]
    activated = F.silu(pre)
    grad_out = (activated * gate).transpose(-1, -2) @ weighted
    hidden = weighted @ w_out.transpose(-1, -2)
    grad_in = x.transpose(-1, -2) @ (hidden * gate * silu_grad(pre))
    grad_gate = x.transpose(-1, -2) @ (hidden * activated)
    return grad_in, grad_gate, grad_out


def renormalize(weight: torch.Tensor, target_norms: torch.Tensor) -> torch.Tensor:
    """weight (..., in, out) with each column rescaled to target_norms (..., 1, out)."""
    return weight * (target_norms / weight.norm(dim=-2, keepdim=True).clamp_min(RENORM_FLOOR))


def column_norms(weights) -> tuple[torch.Tensor, ...]:
    """The renormalisation targets of `segment_write`: each matrix's column norms (..., 1, out)."""
    return tuple(w.norm(dim=-2, keepdim=True) for w in weights)


def segment_write(weights, momentum, target_norms, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor,
                  beta: torch.Tensor, backend: str = "auto", saved=None):
    """One segment's write (module docstring) from its k (B, H, T, in), v (B, H, T, out),
    lr (B, H, T), beta (B, H). `saved`: `swiglu_forward(weights, k)[1]` if already computed.
    Returns (new weights, new momentum)."""
    saved = saved if saved is not None else swiglu_forward(weights, k)[1]
    grads = swiglu_grads(weights, saved, -v, lr / k.shape[2])  # dl/dM = -v (eq. 7)
    updated = [kernel_memory_update(w, s, g, beta, torch.zeros_like(beta), 0, backend)
               for w, s, g in zip(weights, momentum, grads)]
    new_weights = tuple(renormalize(w, n) for (w, _), n in zip(updated, target_norms))
    return new_weights, tuple(s for _, s in updated)
