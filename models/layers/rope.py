"""Rotary position embedding (RoFormer), computed from explicit positions.

Two layouts. `rope_angles` / `apply_rope` (the project's from-scratch models, torchtitan's
layout: consecutive pairs rotate): angles in float64 and rotations in float32 (float64 for
float64 inputs), so float64 models are exact to float64 rounding: shifting every position
by the same amount (as streaming does) changes nothing beyond 1e-15. `rope_inv_freq` /
`apply_half_rope` (pretrained backbones: Hugging Face's layout, the two halves of a head
rotate together, so checkpoints load without permuting q/k): angles in float32 as
transformers computes them, to match its outputs."""

from __future__ import annotations

import math

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


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies as Hugging Face Llama / Qwen3 compute
    them, with Llama 3's frequency scaling when `scaling` has rope_type "llama3" (keys
    factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"rope scaling '{kind}' is not supported: only 'llama3' (or none)")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def apply_half_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x (B, H, L, D), positions (B, L): Hugging Face's RoPE layout (the two halves of each
    head rotate together, `rotate_half`), angles in float32 as transformers computes them."""
    angles = positions.float()[:, None, :, None] * inv_freq.to(x.device)
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x.chunk(2, -1)
    return x * cos + torch.cat((-second, first), -1) * sin
