"""A plain-torch Transformer++ decoder block (Llama: RMSNorm, GQA attention with RoPE, SwiGLU).

The same computation as torchtitan's `Llama3TransformerBlock` (tests/test_mela.py loads one
block's weights into the other and compares outputs), written with torch only so that models
built from it (Mela's decoder) ship inside a Hugging Face export. Parameter names follow
torchtitan's unfused layout: attention.{wq,wk,wv,wo}, feed_forward.{w1,w2,w3},
attention_norm, ffn_norm. RoPE rotates consecutive pairs, as torchtitan's ComplexRoPE.

Shapes: x (B, L, dim), positions (L,) or (B, L) -> (B, L, dim).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.ffn import SwiGLU
from models.layers.rope import apply_rope, rope_angles


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE. `gated`: the attention output is
    multiplied elementwise by sigmoid(x W_g) before the output projection (gated
    attention, Qiu et al. 2025, as in Mela's memory blocks)."""

    DIAGNOSTIC_QUERIES = 64  # queries (the last of the sequence) whose attention mass on the prefix is recorded

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, rope_theta: float, gated: bool = False,
                 prefix_keys: int = 0):
        super().__init__()
        self.prefix_keys = prefix_keys
        self.last_prefix_mass: torch.Tensor | None = None
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(f"dim {dim} must divide by n_heads {n_heads}, and n_heads by n_kv_heads {n_kv_heads}")
        self.head_dim, self.rope_theta = dim // n_heads, rope_theta
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.wg = nn.Linear(dim, dim, bias=False) if gated else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = (w(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        cos, sin = rope_angles(positions.expand(x.shape[0], -1), self.head_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        if self.prefix_keys:
            self._note_prefix_mass(q, k)
        out = out.transpose(1, 2).flatten(-2)
        if self.wg is not None:
            out = out * torch.sigmoid(self.wg(x))
        return self.wo(out)


    def _note_prefix_mass(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Diagnostics: mean attention probability the last DIAGNOSTIC_QUERIES queries put on
        the first `prefix_keys` keys (Mela: its memory tokens). q (B, H, L, d), k (B, Hkv, L, d)."""
        with torch.no_grad():
            length = q.shape[2]
            first = max(length - self.DIAGNOSTIC_QUERIES, 0)
            keys = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
            scores = (q[:, :, first:] @ keys.transpose(-1, -2)).float() / math.sqrt(self.head_dim)
            rows = torch.arange(first, length, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(length, device=q.device)[None, :] > rows, float("-inf"))
            self.last_prefix_mass = scores.softmax(-1)[..., : self.prefix_keys].sum(-1).mean()


class DecoderBlock(nn.Module):
    """x + Attn(norm x), then + SwiGLU(norm x)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, rope_theta: float, norm_eps: float,
                 prefix_keys: int = 0):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention = Attention(dim, n_heads, n_kv_heads, rope_theta, prefix_keys=prefix_keys)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.feed_forward = SwiGLU(dim, ffn_hidden)

    def reset_parameters(self, std: float, n_layers: int) -> None:
        """N(0, std) inputs, residual outputs scaled by 1/sqrt(2 n_layers), norms to one."""
        residual_std = std / math.sqrt(2 * n_layers)
        with torch.no_grad():
            for linear in (self.attention.wq, self.attention.wk, self.attention.wv, self.feed_forward.w1,
                           self.feed_forward.w3):
                nn.init.normal_(linear.weight, std=std)
            for linear in (self.attention.wo, self.feed_forward.w2):
                nn.init.normal_(linear.weight, std=residual_std)
            self.attention_norm.reset_parameters()
            self.ffn_norm.reset_parameters()

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), positions)
        return x + self.feed_forward(self.ffn_norm(x))
