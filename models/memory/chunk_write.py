"""One chunk's write of the Titans memory, as plain functions (models/memory/neural_memory.py's
module docstring states the rules; its `chunk_step` calls these): the memory MLP's forward,
the weighted sums of the associative loss's per-token gradients (explicit backward), the gates'
decay products and weights for all chunks at once, the surprise bound, and the per-token rule's
state update.

Shapes: weights (B, H, in, out); tokens (B, H, C, d); token weights (B, H, C, K) for K weighted
sums; gradient sums (B, H, K, in, out).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import full_precision
from kernels.reference import silu_grad
from models.layers.tracing import compiling


class SiluBackward(torch.autograd.Function):
    """grad * silu'(x) (the explicit backward through a SiLU) in one op (aten.silu_backward),
    keeping only (grad, x) for its own backward, where silu'(x) = s (1 + x (1 - s)) and
    silu''(x) = s (1 - s) (2 + x (1 - 2 s)), s = sigmoid(x)."""

    @staticmethod
    def forward(ctx, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad, x)
        return torch.ops.aten.silu_backward(grad, x)

    @staticmethod
    def backward(ctx, out_grad: torch.Tensor):
        grad, x = ctx.saved_tensors
        s = torch.sigmoid(x)
        return torch.ops.aten.silu_backward(out_grad, x), out_grad * grad * s * (1 - s) * (2 + x * (1 - 2 * s))


def silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad * silu'(x): eagerly `SiluBackward` (one op); traced by torch.compile, the product with
    `silu_grad` (Inductor decomposes aten.silu_backward into the same pointwise ops, which fuse
    with their neighbours, and the partitioner chooses what to keep). A custom autograd.Function
    in a graph makes AOTAutograd's cache bypass it (torch 2.13: "Unsupported call_function
    target autograd_function_apply"), so every launch retraced and repartitioned each such
    graph: 25 of the 34 s of Mela debug's first compiled step with a warm cache."""
    if compiling():
        return grad * silu_grad(x)
    return SiluBackward.apply(grad, x)


def mlp_forward(weights, x: torch.Tensor, residual: bool = False):
    """M(x) for x (B, H, N, d) (x + MLP(x) with `residual`); also returns each layer's
    (input, pre-activation)."""
    saved, inputs = [], x
    for i, w in enumerate(weights):
        pre = x @ w
        saved.append((x, pre))
        x = F.silu(pre) if i < len(weights) - 1 else pre
    return (inputs + x if residual else x), saved


def associative_grads(weights, saved, out: torch.Tensor, v: torch.Tensor, token_weights: torch.Tensor):
    """Weighted sums of per-token gradients of l = ||M(k_t) - v_t||^2 (explicit backward):
    for each weight matrix, (B, H, K, in, out) = sum_t token_weights[..., t, j] / 2 grad_W l_t
    for the K weightings j. The squared error's factor 2 is left to the token weights
    (`chunk_gates` folds it in once for all chunks): the error back-propagated is M(k_t) - v_t.
    `saved`, `out` from `mlp_forward(weights, k)`; v (B, H, N, d); token_weights (B, H, N, K).
    The K weightings go into the matmul's rows (one 4-D matmul per weight matrix, no copy)."""
    delta = out - v
    grads = [None] * len(weights)
    for i in reversed(range(len(weights))):
        weighted = (saved[i][0][..., None, :] * token_weights[..., None]).flatten(-2)  # (B, H, N, K * in)
        grads[i] = (weighted.transpose(-1, -2) @ delta).unflatten(-2, (token_weights.shape[-1], -1))
        if i > 0:
            delta = silu_backward(delta @ weights[i].transpose(-1, -2), saved[i - 1][1])
    return grads


def decay_products(log_gate: torch.Tensor) -> torch.Tensor:
    """log_gate (..., C) of g_1..g_C -> (..., C + 1, C + 1) D with D[t, i] = prod_{i<j<=t} g_j
    for 0 <= i <= t <= C (position 0 = the chunk start; D[t, t] = 1) and 0 above the
    diagonal. A segment sum in log space: no division, exact zeros for g = 0 (log = -inf)."""
    n = log_gate.shape[-1] + 1
    padded = F.pad(log_gate, (1, 0))[..., :, None].expand(*log_gate.shape[:-1], n, n)  # [t, i] = log g_t
    rows = torch.arange(n, device=log_gate.device)
    strictly_lower = rows[:, None] > rows[None, :]
    sums = padded.masked_fill(~strictly_lower, 0).cumsum(-2)
    return sums.masked_fill(rows[:, None] < rows[None, :], float("-inf")).exp()


def chunk_gates(theta: torch.Tensor, log_eta: torch.Tensor, log_keep: torch.Tensor, gates: str):
    """Everything a chunk's write takes from the gates alone, for all N chunks at once
    (batched over the chunk dimension, outside the sequential loop). theta, log_eta,
    log_keep (B, H, N, C). Returns (token_weights (B, H, N, C, K), decays (B, H, N, 2, 2) or
    (B, H, N, 2)).

    gates="token" (the unrolled scan of the module docstring, thesis eq. 2.39-2.40 over a
    chunk; E, R from `decay_products`): K = 2 weightings, each times -2 (the squared error's
    2, `associative_grads`, and the minus of the surprise), so a chunk's write of the stacked
    state [M; S] is one 2 x 2 mix plus the weighted sums G_M, G_S (`token_scan_update`):
    M_C = R_0 M_0 + (sum_t R_t E_t) S_0 + G_M,  S_C = E_C S_0 + G_S, with
    token_weights[..., i, :] = -2 theta_i (sum_{t>=i} R_t prod_{i<j<=t} eta_j, prod_{i<j<=C} eta_j),
    decays = [[prod_j (1 - alpha_j), sum_t R_t E_t], [0, prod_j eta_j]].
    gates="chunk": K = 1, token_weights = 2 theta; decays = (mean eta, mean alpha)."""
    if gates == "chunk":
        return 2 * theta[..., None], torch.stack([log_eta.exp(), 1 - log_keep.exp()], -1).mean(-2)
    eta, keep = decay_products(torch.stack([log_eta, log_keep])).unbind(0)  # [t, i] = prod_{i<j<=t} eta_j
    to_end = keep[..., -1, :]  # [t] = prod_{t<j<=C} (1 - alpha_j)
    carried = (to_end[..., 1:] * eta[..., 1:, 0]).sum(-1)  # sum_t R_t E_t: the old momentum's share in M_C
    momentum_weights = theta * eta[..., -1, 1:]
    weight_weights = theta * (to_end[..., 1:, None] * eta[..., 1:, 1:]).sum(-2)  # a reduction, not a matmul: fuses
    token_weights = -2 * torch.stack([weight_weights, momentum_weights], -1)
    # [[R_0, carried], [0, E_C]] as one pointwise sum of padded entries (a stack of four would be
    # four kernels under Inductor, one per entry)
    mix = F.pad(keep[..., -1, :1], (0, 3)) + F.pad(carried[..., None], (1, 2)) + F.pad(eta[..., -1, :1], (3, 0))
    return token_weights, mix.unflatten(-1, (2, 2))


def surprise_limit(token_weights: torch.Tensor, bound: float) -> torch.Tensor:
    """The norm each weighted gradient sum may reach (module docstring, `max_update_norm`):
    token_weights (..., C, K) -> (..., K) = bound * sum_t |w_t| / 2 (the sum's weights of the
    surprises, `associative_grads`), at least the dtype's smallest normal number."""
    total = token_weights.abs().sum(-2)
    return (0.5 * bound * total).clamp_min(torch.finfo(total.dtype).tiny)


def clip_surprise(grads, limit: torch.Tensor):
    """Each weighted gradient sum of `grads` (tensors (B, H, K, in, out)), G = sum_t w_t u_t / 2
    (`associative_grads`: u_t the token's surprise), scaled to Frobenius norm at most its
    `limit` (B, H, K) (`surprise_limit`): the weighted mean of the chunk's surprise norms at most
    the bound. Returns (grads, scales (len(grads), B, H, K)): s = limit / max(||G||, limit), exactly
    1 where G is within its limit (x / x = 1 in IEEE arithmetic), so an unclipped sum is unchanged
    bit for bit. The scales are constants in backward, as a gradient clip's are (d(sG)/dG = s):
    the gradients of unclipped sums equal the unbounded ones, and the bound adds 2 + len(grads)
    launches forward and none backward besides the products."""
    norms = torch.stack([g.flatten(-2).norm(dim=-1) for g in grads])  # (M, B, H, K)
    scales = (limit / norms.clamp_min(limit)).detach()
    return [g * scale[..., None, None] for g, scale in zip(grads, scales.unbind(0))], scales


def token_scan_update(state, grads, mix):
    """Titans' per-token rule over one chunk (module docstring, thesis eq. 2.39-2.40 unrolled):
    state (B, H, 2, in, out) per weight matrix, the stacked [M_0; S_0]; grads (B, H, 2, in, out)
    the chunk's weighted gradient sums [G_M; G_S] (surprise signs and factors in them,
    `chunk_gates`); mix (B, H, 2, 2) = [[R_0, sum_t R_t E_t], [0, E_C]]. Returns the new
    stacked state [M_C; S_C] = mix [M_0; S_0] + [G_M; G_S], one batched matmul per matrix
    (one pass over the state forward, two backward). Autocast is off there: a lower-precision
    autocast would run that matmul, hence the state, in bf16."""
    with full_precision(mix.device):
        return tuple(torch.baddbmm(g.to(s.dtype).flatten(0, 1).flatten(-2), mix.flatten(0, 1),
                                   s.flatten(0, 1).flatten(-2)).view_as(s) for s, g in zip(state, grads))
