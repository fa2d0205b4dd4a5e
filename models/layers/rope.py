"""Rotary position embedding (RoFormer), computed from explicit positions.

Angles are computed in float64 and rotations in float32 (float64 for float64 inputs), so
float64 models are exact to float64 rounding: shifting every position by the same amount
(as streaming does) changes nothing beyond 1e-15."""

from __future__ import annotations

import torch


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, L) -> cos, sin (B, 1, L, head_dim // 2), in float64."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[:, None, :, None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, L, D): rotate consecutive pairs (x[2i], x[2i+1]) by the angle of their position."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    pairs = x.to(work).unflatten(-1, (-1, 2))
    cos, sin = cos.to(work), sin.to(work)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)
