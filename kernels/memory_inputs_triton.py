"""Triton kernel of the memory's chunk inputs (kernels/memory_inputs.py states the maths and
holds the torch reference): one program per (batch, head, chunk) reads the chunk's rows of the
q/k/v projection and of the gate logits and writes the whole-sequence kernels' inputs, so the
preparation between the memory's projection and its kernel is one launch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_inputs_fwd(QKV, LOGITS, BIAS, Q, K, V, TW, DECAYS,
                     qkv_stride_b, qkv_stride_t, logit_stride_b, logit_stride_t,
                     H, N, C, D, max_lr, forget_offset,
                     HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, VALUE_SILU: tl.constexpr,
                     MOMENTUM: tl.constexpr, FORGET: tl.constexpr, ROUND: tl.constexpr,
                     BC: tl.constexpr, BD: tl.constexpr):
    """Program (b, h, n): rows t = n C + (0..C-1). QKV (B, T, 3 H D) with unit feature stride,
    LOGITS (B, T, 3 H) likewise, BIAS (3 H) when HAS_BIAS; outputs contiguous fp32: Q, K, V
    (B, H, N, C, D), TW (B, H, N, C), DECAYS (B, H, N, 2). ROUND rounds each value the layer
    keeps in the activation dtype (q, k, v and the biased logits) to QKV's dtype first."""
    pid = tl.program_id(0)
    n = pid % N
    bh = pid // N
    h = bh % H
    b = bh // H
    rows = tl.arange(0, BC)
    cols = tl.arange(0, BD)
    row_ok = rows < C
    tile_ok = row_ok[:, None] & (cols[None, :] < D)
    t = n * C + rows
    source = QKV + b * qkv_stride_b + t[:, None] * qkv_stride_t + h * D + cols[None, :]
    target = ((bh * N + n) * C + rows[:, None]) * D + cols[None, :]
    act = QKV.dtype.element_ty
    _heads_tile(source, Q + target, tile_ok, act, QK_NORM, QK_NORM, ROUND)
    _heads_tile(source + H * D, K + target, tile_ok, act, QK_NORM, QK_NORM, ROUND)
    _heads_tile(source + 2 * H * D, V + target, tile_ok, act, VALUE_SILU, False, ROUND)

    logit_rows = LOGITS + b * logit_stride_b + t * logit_stride_t + h
    theta = _gate_logit(logit_rows, BIAS, 0 * H, h, row_ok, act, HAS_BIAS, ROUND)
    eta = _gate_logit(logit_rows, BIAS, 1 * H, h, row_ok, act, HAS_BIAS, ROUND)
    alpha = _gate_logit(logit_rows, BIAS, 2 * H, h, row_ok, act, HAS_BIAS, ROUND)
    tl.store(TW + (bh * N + n) * C + rows, 2.0 * max_lr * tl.sigmoid(theta), mask=row_ok)
    eta = tl.sigmoid(eta) if MOMENTUM else tl.zeros_like(eta)
    alpha = 1.0 - tl.sigmoid(-(alpha + forget_offset)) if FORGET else tl.zeros_like(alpha)
    decays = DECAYS + (bh * N + n) * 2
    tl.store(decays, tl.sum(tl.where(row_ok, eta, 0.0), axis=0) / C)
    tl.store(decays + 1, tl.sum(tl.where(row_ok, alpha, 0.0), axis=0) / C)


@triton.jit
def _heads_tile(source, target, tile_ok, act: tl.constexpr, SILU: tl.constexpr, NORM: tl.constexpr, ROUND: tl.constexpr):
    """One (C, D) tile of q, k or v: SiLU when SILU, then the rows' L2 norm when NORM (q and k
    take both from QK_NORM, v its SiLU alone), rounded to `act` when ROUND; stored fp32."""
    x = tl.load(source, mask=tile_ok, other=0.0).to(tl.float32)
    if SILU:
        x = x * tl.sigmoid(x)
    if NORM:
        x = x / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-12)[:, None]
    if ROUND:
        x = x.to(act).to(tl.float32)
    tl.store(target, x, mask=tile_ok)


@triton.jit
def _gate_logit(rows, BIAS, offset, h, row_ok, act: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND: tl.constexpr):
    """One gate's logits over the chunk's rows (fp32), its bias added (and rounded as the layer's)."""
    g = tl.load(rows + offset, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        g = g + tl.load(BIAS + offset + h).to(tl.float32)
        if ROUND:
            g = g.to(act).to(tl.float32)
    return g
