"""Small building blocks shared by the project's models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """Transformer++ feed-forward: w2(silu(w1 x) * w3 x). x (..., dim) -> (..., dim)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def swiglu_hidden(dim: int, multiple_of: int = 256) -> int:
    """Llama's hidden width: 2/3 of 4*dim, rounded up to a multiple."""
    hidden = int(2 * 4 * dim / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)
