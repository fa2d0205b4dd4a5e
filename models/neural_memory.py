"""Titans neural long-term memory (003_*.txt section 2.3; 002_*.txt section 2.1, eq. 2-11).

The memory is a per-head MLP `M` (fast weights) written at test time by gradient descent
on the associative loss `l(M; k_t, v_t) = ||M(k_t) - v_t||^2` (eq. 2.38 / 8):

    S_t = eta_t S_{t-1} - theta_t grad l(M_{t-1}; k_t, v_t)          (eq. 2.39 / 3)
    M_t = (1 - alpha_t) M_{t-1} + S_t                                (eq. 2.40)
    M_t = (1 - alpha_t) M_{t-1} + NewtonSchulz_k(S_t)                (Mela eq. 10-11, optional)
    y_t = M_{t-1}(q_t)                                               (eq. 2.41 / 9)

Chunked training (the fast path): the sequence is cut into chunks of C tokens; chunk c
is written with one step whose gradient is the theta-weighted sum of its tokens'
gradients, all taken against M_{c-1} (the state after chunk c-1), and the tokens of
chunk c read M_{c-1}. Chunks follow one another in order (not all against the initial
weights). Per chunk, eta and alpha are the means of their per-token values. With C = 1
this is plain online gradient descent token by token.

Choices where the papers are silent (tested):
- `M` has no residual inside: depth 1 is `x W`, depth L applies L matrices with SiLU
  between them (hidden width = expansion * head_dim). Initial weights are learned
  (`learned_init`), else a fixed random draw (zeros would never learn for depth >= 2).
- The loss is summed over tokens and features; theta = max_lr * sigmoid(.), max_lr 0.01:
  a chunk's step sums its tokens' gradients, so it stays stable for chunks up to 64
  tokens with unit-norm keys (0.1 diverged to NaN within 10 steps for MAL at debug size).
- q and k go through SiLU then L2 normalisation (`qk_norm`), as in Titans.
- A trailing partial chunk is not written yet: its keys/values wait in the state
  (`MemoryState.pending`) until the chunk completes in a later call, so processing a
  sequence in segments of any length gives exactly the one-pass outputs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels import memory_update as kernel_memory_update


@dataclass
class NeuralMemoryConfig:
    dim: int = 256
    n_heads: int = 4
    head_dim: int = 64
    depth: int = 2
    expansion: int = 4
    chunk_size: int = 64
    momentum: bool = True
    forget: bool = True
    newton_schulz_steps: int = 0  # 0: plain update (Titans); 5: Mela eq. 10
    kernel_backend: str = "auto"  # kernels.memory_update backend: auto / triton / torch / compiled
    compiled_chunk_step: bool = False  # torch.compile each chunk step (CPU fast path; compiles once per shape)
    qk_norm: bool = True
    learned_init: bool = True
    max_lr: float = 0.01

    def layer_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of each memory weight matrix, e.g. depth 2: [(d, e*d), (e*d, d)]."""
        if self.depth == 1:
            return [(self.head_dim, self.head_dim)]
        hidden = self.expansion * self.head_dim
        return [(self.head_dim, hidden)] + [(hidden, hidden)] * (self.depth - 2) + [(hidden, self.head_dim)]


class MemoryState(NamedTuple):
    """Fast weights and momentum, each a tuple of (B, H, in, out); `pending` holds the
    (k, v, theta, eta, alpha) of a not-yet-complete chunk: (B, H, n, d) / (B, H, n)."""

    weights: tuple[torch.Tensor, ...]
    momentum: tuple[torch.Tensor, ...]
    pending: tuple[torch.Tensor, ...]

    def detach(self) -> "MemoryState":
        return MemoryState(*(tuple(t.detach() for t in part) for part in self))


def silu_grad(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def mlp_forward(weights, x: torch.Tensor):
    """M(x) for x (B, H, N, d); also returns each layer's (input, pre-activation)."""
    saved = []
    for i, w in enumerate(weights):
        pre = x @ w
        saved.append((x, pre))
        x = F.silu(pre) if i < len(weights) - 1 else pre
    return x, saved


def associative_grads(weights, k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor):
    """grad_W sum_t theta_t ||M(k_t) - v_t||^2 for each weight (explicit backward).
    k, v (B, H, N, d); theta (B, H, N)."""
    out, saved = mlp_forward(weights, k)
    delta = 2 * theta[..., None] * (out - v)
    grads = [None] * len(weights)
    for i in reversed(range(len(weights))):
        inp, _ = saved[i]
        grads[i] = inp.transpose(-1, -2) @ delta
        if i > 0:
            delta = (delta @ weights[i].transpose(-1, -2)) * silu_grad(saved[i - 1][1])
    return grads


def memory_update(weights, momentum, grads, eta: torch.Tensor, alpha: torch.Tensor, ns_steps: int, backend: str = "auto"):
    """One chunk step for every weight matrix: S = eta S - G; M = (1 - alpha) M + [NS](S).
    eta, alpha (B, H). Runs through `kernels.memory_update` (fused Triton kernel on GPU)."""
    updated = [kernel_memory_update(w, s, g, eta, alpha, ns_steps, backend) for w, s, g in zip(weights, momentum, grads)]
    return tuple(w for w, _ in updated), tuple(s for _, s in updated)


def chunk_step(weights, momentum, q_c, k_c, v_c, theta_c, eta_c, alpha_c, ns_steps: int, backend: str):
    """One chunk: its tokens read the state left by the previous chunk, then the chunk is
    written. q_c, k_c, v_c (B, H, C, d); theta_c, eta_c, alpha_c (B, H, C).
    Returns (y_c, new weights, new momentum)."""
    y_c = mlp_forward(weights, q_c)[0]
    grads = associative_grads(weights, k_c, v_c, theta_c)
    weights, momentum = memory_update(weights, momentum, grads, eta_c.mean(-1), alpha_c.mean(-1), ns_steps, backend)
    return y_c, weights, momentum


@functools.cache
def compiled_chunk_step():
    """`chunk_step` through torch.compile (fused elementwise work; one graph per shape)."""
    return torch.compile(chunk_step, dynamic=False, fullgraph=True)


def chunked_memory(state: MemoryState, q, k, v, theta, eta, alpha, chunk: int, ns_steps: int, backend: str = "auto",
                   compiled: bool = False):
    """Read and write a stream. q (B, H, T, d) are the new tokens' queries; k, v, theta,
    eta, alpha cover pending + new tokens (p + T). Returns y (B, H, T, d), new state."""
    pending = state.pending[0].shape[2]
    q = F.pad(q, (0, 0, pending, 0))  # placeholder queries for the pending tokens
    total = q.shape[2]
    full = total - total % chunk
    # Split once into per-chunk views (unbind): slicing chunk by chunk would make autograd
    # scatter every chunk's gradient into a full-length zero tensor (quadratic in T).
    per_chunk = [t[:, :, :full].unflatten(2, (-1, chunk)).unbind(2) for t in (q, k, v, theta, eta, alpha)]
    weights, momentum = state.weights, state.momentum
    step = compiled_chunk_step() if compiled else chunk_step
    outputs = []
    for chunk_inputs in zip(*per_chunk):
        y_c, weights, momentum = step(weights, momentum, *chunk_inputs, ns_steps, backend)
        outputs.append(y_c)
    if full < total:
        outputs.append(mlp_forward(weights, q[:, :, full:])[0])
    y = torch.cat(outputs, 2)[:, :, pending:]
    new_pending = tuple(t[:, :, full:] for t in (k, v, theta, eta, alpha))
    return y, MemoryState(weights, momentum, new_pending)


class NeuralMemory(nn.Module):
    """Multi-head neural memory layer: x (B, T, dim) -> (y (B, T, dim), MemoryState)."""

    # Added to the (theta, eta, alpha) logits: the forget gate starts near
    # sigmoid(-4) = 0.018, so a fresh memory forgets little (a fixed offset rather
    # than a bias init keeps the init a plain elementwise op under FSDP sharding).
    GATE_OFFSETS = torch.tensor([0.0, 0.0, -4.0])[:, None, None]

    def __init__(self, cfg: NeuralMemoryConfig):
        super().__init__()
        self.cfg = cfg
        self.last_weight_norm = self.last_momentum_norm = None
        inner = cfg.n_heads * cfg.head_dim
        self.to_q = nn.Linear(cfg.dim, inner, bias=False)
        self.to_k = nn.Linear(cfg.dim, inner, bias=False)
        self.to_v = nn.Linear(cfg.dim, inner, bias=False)
        self.to_gates = nn.Linear(cfg.dim, 3 * cfg.n_heads)  # theta, eta, alpha logits
        self.out = nn.Linear(inner, cfg.dim, bias=False)
        initial = [torch.empty(cfg.n_heads, i, o) for i, o in cfg.layer_shapes()]
        if cfg.learned_init:
            self.initial_weights = nn.ParameterList(nn.Parameter(w) for w in initial)
        else:
            for i, w in enumerate(initial):
                self.register_buffer(f"initial_weight_{i}", w)
        self.reset_parameters()

    def initial(self) -> list[torch.Tensor]:
        if self.cfg.learned_init:
            return list(self.initial_weights)
        return [getattr(self, f"initial_weight_{i}") for i in range(self.cfg.depth)]

    def reset_parameters(self) -> None:
        std = 0.02
        with torch.no_grad():
            for linear in (self.to_q, self.to_k, self.to_v, self.out):
                nn.init.normal_(linear.weight, std=std)
            nn.init.normal_(self.to_gates.weight, std=std)
            nn.init.zeros_(self.to_gates.bias)  # theta = max_lr / 2, eta = 0.5 at first
            for w in self.initial():
                nn.init.normal_(w, std=w.shape[-2] ** -0.5)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (self.cfg.n_heads, self.cfg.head_dim)).transpose(1, 2)

    def empty_state(self, batch: int, device=None, dtype=None) -> MemoryState:
        weights = tuple(w.expand(batch, *w.shape) for w in self.initial())
        if dtype is not None:
            weights = tuple(w.to(dtype) for w in weights)
        h, d = self.cfg.n_heads, self.cfg.head_dim
        like = weights[0]
        pending = (like.new_zeros(batch, h, 0, d), like.new_zeros(batch, h, 0, d)) + tuple(
            like.new_zeros(batch, h, 0) for _ in range(3)
        )
        return MemoryState(weights, tuple(torch.zeros_like(w) for w in weights), pending)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        q = self._heads(self.to_q(x))
        return F.normalize(F.silu(q), dim=-1) if self.cfg.qk_norm else q

    def retrieve(self, x: torch.Tensor, state: MemoryState) -> torch.Tensor:
        """Read without writing: M*(q_t) with the state's current weights (eq. 2.41)."""
        y, _ = mlp_forward(state.weights, self.queries(x))
        return self.out(y.transpose(1, 2).flatten(-2))

    def forward(self, x: torch.Tensor, state: MemoryState | None = None):
        cfg = self.cfg
        if state is None:
            state = self.empty_state(x.shape[0], dtype=x.dtype)
        k, v = self._heads(self.to_k(x)), self._heads(self.to_v(x))
        if cfg.qk_norm:
            k = F.normalize(F.silu(k), dim=-1)
        logits = self.to_gates(x).transpose(1, 2).unflatten(1, (3, cfg.n_heads)) + self.GATE_OFFSETS.to(x.dtype)
        theta, eta, alpha = torch.sigmoid(logits).unbind(1)
        theta = cfg.max_lr * theta
        eta = eta if cfg.momentum else torch.zeros_like(eta)
        alpha = alpha if cfg.forget else torch.zeros_like(alpha)
        new = (k, v, theta, eta, alpha)
        stream = [torch.cat([p, n], 2) for p, n in zip(state.pending, new)]
        y, state = chunked_memory(state, self.queries(x), *stream, cfg.chunk_size, cfg.newton_schulz_steps,
                                  cfg.kernel_backend, cfg.compiled_chunk_step)
        # Diagnostics of the last forward (Frobenius norms over all weights / momenta).
        self.last_weight_norm = torch.stack([w.detach().norm() for w in state.weights]).norm()
        self.last_momentum_norm = torch.stack([s.detach().norm() for s in state.momentum]).norm()
        return self.out(y.transpose(1, 2).flatten(-2)), state
