"""The decoder blocks' feed-forward networks. x (..., dim) -> (..., dim)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MLP_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}
FFNS = ("swiglu", *MLP_ACTIVATIONS)  # `feed_forward`'s kinds


class SwiGLU(nn.Module):
    """Transformer++ feed-forward: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MLP(nn.Module):
    """Two-layer feed-forward w2(act(w1 x)) with an element-wise `act` (the Locas MLP-FFN LM's,
    which Locas-MLP extends sideways: models/memory/locas.py reads `act`)."""

    def __init__(self, dim: int, hidden: int, activation: str):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.act = MLP_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)))


def feed_forward(dim: int, hidden: int, kind: str) -> nn.Module:
    """The FFN of `kind` (FFNS): "swiglu" is SwiGLU, an activation name of MLP_ACTIVATIONS the MLP."""
    if kind not in FFNS:
        raise ValueError(f"feed-forward '{kind}' unknown: choose one of {FFNS}")
    return SwiGLU(dim, hidden) if kind == "swiglu" else MLP(dim, hidden, kind)


def swiglu_hidden(dim: int, multiple_of: int = 256) -> int:
    """Llama's hidden width: 2/3 of 4*dim, rounded up to a multiple."""
    hidden = int(2 * 4 * dim / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)
