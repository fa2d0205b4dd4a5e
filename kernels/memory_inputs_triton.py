"""Triton kernel of the memory's chunk inputs (kernels/memory_inputs.py states the maths and
holds the torch reference): one program per (batch, head, chunk) reads the chunk's rows of the
q/k/v projection (and, with a conv, the K - 1 rows before them: of the projection, or of the
conv's history at the call's start) and of the gate logits, and writes the whole-sequence
kernels' inputs, so the preparation between the memory's projection and its kernel is one launch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_inputs_fwd(QKV, LOGITS, BIAS, CONV_W, HISTORY, Q, K, V, TW, DECAYS,
                     qkv_stride_b, qkv_stride_t, logit_stride_b, logit_stride_t, history_stride_b, history_stride_t,
                     H, N, C, D, max_lr, forget_offset,
                     HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, VALUE_SILU: tl.constexpr,
                     MOMENTUM: tl.constexpr, FORGET: tl.constexpr, ROUND: tl.constexpr, TOKEN: tl.constexpr,
                     TAPS: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Program (b, h, n): rows t = n C + (0..C-1). QKV (B, T, 3 H D) with unit feature stride,
    LOGITS (B, T, 3 H) likewise, BIAS (3 H) when HAS_BIAS, with TAPS > 0 the conv's CONV_W
    (3 H D, 1, TAPS) contiguous and HISTORY (B, TAPS - 1, 3 H D) of unit feature stride; outputs
    contiguous fp32: Q, K, V (B, H, N, C, D), TW (B, H, N, C, 1 or 2 with TOKEN), DECAYS
    (B, H, N, 2, or 2 x 2 with TOKEN). ROUND rounds each value the layer keeps in the activation
    dtype (the conv's output, q, k, v and the biased logits) to QKV's dtype first."""
    n, bh, h, b, rows, cols, row_ok, col_ok, t = _program(N, H, C, D, BC, BD)
    tile_ok = row_ok[:, None] & col_ok[None, :]
    target = ((bh * N + n) * C + rows[:, None]) * D + cols[None, :]
    act = QKV.dtype.element_ty
    channels = h * D + cols
    for part in tl.static_range(3):  # q, k, v
        x = _conved_tile(QKV, HISTORY, CONV_W, b, t, part * H * D + channels, row_ok, col_ok, qkv_stride_b,
                         qkv_stride_t, history_stride_b, history_stride_t, act, TAPS, ROUND, BC, BD)
        if part == 0:
            tl.store(Q + target, _head_values(x, act, QK_NORM, QK_NORM, ROUND), mask=tile_ok)
        elif part == 1:
            tl.store(K + target, _head_values(x, act, QK_NORM, QK_NORM, ROUND), mask=tile_ok)
        else:
            tl.store(V + target, _head_values(x, act, VALUE_SILU, False, ROUND), mask=tile_ok)

    logit_rows = LOGITS + b * logit_stride_b + t * logit_stride_t + h
    theta = max_lr * tl.sigmoid(_gate_logit(logit_rows, BIAS, 0 * H, h, row_ok, act, HAS_BIAS, ROUND))
    eta = _gate_logit(logit_rows, BIAS, 1 * H, h, row_ok, act, HAS_BIAS, ROUND)
    alpha = _gate_logit(logit_rows, BIAS, 2 * H, h, row_ok, act, HAS_BIAS, ROUND)
    chunk_row = (bh * N + n) * C + rows
    if TOKEN:
        _token_gates(theta, eta, alpha + forget_offset, rows, row_ok, C, TW + (bh * N + n) * C * 2,
                     DECAYS + (bh * N + n) * 4, MOMENTUM, FORGET)
    else:
        tl.store(TW + chunk_row, 2.0 * theta, mask=row_ok)
        eta = tl.sigmoid(eta) if MOMENTUM else tl.zeros_like(eta)
        alpha = 1.0 - tl.sigmoid(-(alpha + forget_offset)) if FORGET else tl.zeros_like(alpha)
        decays = DECAYS + (bh * N + n) * 2
        tl.store(decays, tl.sum(tl.where(row_ok, eta, 0.0), axis=0) / C)
        tl.store(decays + 1, tl.sum(tl.where(row_ok, alpha, 0.0), axis=0) / C)


@triton.jit
def _program(N, H, C, D, BC: tl.constexpr, BD: tl.constexpr):
    """This program's (chunk n, b H + h, head h, batch row b, tile rows, tile columns, valid rows,
    valid columns, sequence positions t = n C + rows)."""
    pid = tl.program_id(0)
    n = pid % N
    bh = pid // N
    rows = tl.arange(0, BC)
    cols = tl.arange(0, BD)
    return n, bh, bh % H, bh // H, rows, cols, rows < C, cols < D, n * C + rows


@triton.jit
def _conved_tile(QKV, HISTORY, CONV_W, b, t, channels, row_ok, col_ok, qkv_stride_b, qkv_stride_t, history_stride_b,
                 history_stride_t, act: tl.constexpr, TAPS: tl.constexpr, ROUND: tl.constexpr, BC: tl.constexpr,
                 BD: tl.constexpr):
    """The (C, D) tile of `channels` at rows t, fp32: as projected without a conv (TAPS 0), else
    the causal conv sum_j w_j [history; qkv]_{t - (TAPS - 1) + j}, rounded to `act` when ROUND."""
    tile_ok = row_ok[:, None] & col_ok[None, :]
    if TAPS == 0:
        x = tl.load(QKV + qkv_stride_b * b + t[:, None] * qkv_stride_t + channels[None, :], mask=tile_ok,
                    other=0.0).to(tl.float32)
    else:
        x = tl.zeros((BC, BD), dtype=tl.float32)
        for j in range(TAPS):
            source = t - (TAPS - 1) + j
            in_call = (source >= 0)[:, None]
            projected = tl.load(QKV + qkv_stride_b * b + source[:, None] * qkv_stride_t + channels[None, :],
                                mask=tile_ok & in_call, other=0.0).to(tl.float32)
            before = tl.load(HISTORY + history_stride_b * b + (source + TAPS - 1)[:, None] * history_stride_t
                             + channels[None, :], mask=tile_ok & ~in_call, other=0.0)
            before = before.to(act).to(tl.float32) if ROUND else before.to(tl.float32)
            weight = tl.load(CONV_W + channels * TAPS + j, mask=col_ok, other=0.0).to(tl.float32)
            x += (projected + before) * weight[None, :]
        if ROUND:
            x = x.to(act).to(tl.float32)
    return x


@triton.jit
def _head_values(x, act: tl.constexpr, SILU: tl.constexpr, NORM: tl.constexpr, ROUND: tl.constexpr):
    """One (C, D) tile of q, k or v: SiLU when SILU, then the rows' L2 norm when NORM (q and k
    take both from QK_NORM, v its SiLU alone), rounded to `act` when ROUND; fp32."""
    if SILU:
        x = x * tl.sigmoid(x)
    if NORM:
        x = x / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-12)[:, None]
    if ROUND:
        x = x.to(act).to(tl.float32)
    return x


@triton.jit
def _log_sigmoid(x):
    return tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _gate_products(eta_logit, forget_logit, rows, row_ok, C, MOMENTUM: tl.constexpr, FORGET: tl.constexpr):
    """The per-token rule's gate products over one chunk's rows (kernels/memory_inputs.py), from
    differences of log-space cumulative sums: R_t = exp(F_C - F_t) (F the cumulative log(1 - alpha)),
    P[t, i] = exp(E_t - E_i) for t >= i (E the cumulative log eta; the identity without momentum).
    Returns (R (BC,), F_C, the [t >= i] mask, P (BC, BC), P[t, 0] = exp(E_t), P[C, i], P[C, 0]), 0
    outside the chunk's rows."""
    log_keep = tl.where(row_ok, _log_sigmoid(-forget_logit), 0.0) if FORGET else tl.zeros_like(eta_logit)
    total_keep = tl.sum(log_keep, 0)
    to_end = tl.where(row_ok, tl.exp(total_keep - tl.cumsum(log_keep, 0)), 0.0)
    lower = (rows[:, None] >= rows[None, :]) & row_ok[:, None]  # [t, i]: t >= i
    if MOMENTUM:
        log_eta = tl.where(row_ok, _log_sigmoid(eta_logit), 0.0)
        cum_eta = tl.cumsum(log_eta, 0)
        total_eta = tl.sum(log_eta, 0)
        products = tl.where(lower, tl.exp(tl.where(lower, cum_eta[:, None] - cum_eta[None, :], 0.0)), 0.0)
        from_start = tl.where(row_ok, tl.exp(cum_eta), 0.0)
        to_chunk_end = tl.where(row_ok, tl.exp(total_eta - cum_eta), 0.0)
        momentum_end = tl.exp(total_eta)
    else:  # eta = 0
        products = tl.where(lower & (rows[:, None] == rows[None, :]), 1.0, 0.0)
        from_start = tl.zeros_like(eta_logit)
        to_chunk_end = tl.where(rows == C - 1, 1.0, 0.0)
        momentum_end = tl.zeros_like(total_keep)
    return to_end, total_keep, lower, products, from_start, to_chunk_end, momentum_end


@triton.jit
def _token_gates(theta, eta_logit, forget_logit, rows, row_ok, C, TW, DECAYS, MOMENTUM: tl.constexpr,
                 FORGET: tl.constexpr):
    """The per-token rule's weights and mix of one chunk (kernels/memory_inputs.py): theta (BC,),
    the eta logits and the forget logits (offset included) over the chunk's rows; stores TW
    (C, 2) and DECAYS (2, 2)."""
    to_end, total_keep, _, products, from_start, to_chunk_end, momentum_end = _gate_products(
        eta_logit, forget_logit, rows, row_ok, C, MOMENTUM, FORGET)
    to_token = tl.sum(to_end[:, None] * products, axis=0)  # sum_{t>=i} R_t P[t, i]
    tl.store(TW + rows * 2, -2.0 * theta * to_token, mask=row_ok)
    tl.store(TW + rows * 2 + 1, -2.0 * theta * to_chunk_end, mask=row_ok)
    tl.store(DECAYS, tl.exp(total_keep))
    tl.store(DECAYS + 1, tl.sum(to_end * from_start, axis=0))
    tl.store(DECAYS + 2, tl.zeros_like(total_keep))
    tl.store(DECAYS + 3, momentum_end)


@triton.jit
def _gate_logit(rows, BIAS, offset, h, row_ok, act: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND: tl.constexpr):
    """One gate's logits over the chunk's rows (fp32), its bias added (and rounded as the layer's)."""
    g = tl.load(rows + offset, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        g = g + tl.load(BIAS + offset + h).to(tl.float32)
        if ROUND:
            g = g.to(act).to(tl.float32)
    return g


@triton.jit
def chunk_inputs_bwd(QKV, LOGITS, BIAS, CONV_W, HISTORY, DQ, DK, DV, DTW, DDECAYS, D_CONVED, D_LOGITS,
                     qkv_stride_b, qkv_stride_t, logit_stride_b, logit_stride_t, history_stride_b, history_stride_t,
                     H, N, C, D, max_lr, forget_offset,
                     HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, VALUE_SILU: tl.constexpr,
                     MOMENTUM: tl.constexpr, FORGET: tl.constexpr, ROUND: tl.constexpr, TOKEN: tl.constexpr,
                     TAPS: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """`chunk_inputs_fwd`'s backward, program (b, h, n) as there: from the gradients of its outputs
    (DQ, DK, DV (B, H, N, C, D), DTW, DDECAYS as the forward's outputs, contiguous fp32) to D_CONVED
    (B, T, 3 H D), the gradient of the convolved projections (of qkv itself without a conv; the
    conv's own backward, which reads the next chunk's rows, is left to the caller), and D_LOGITS
    (B, T, 3 H), both contiguous. The conv is recomputed from QKV and HISTORY as the forward ran it."""
    n, bh, h, b, rows, cols, row_ok, col_ok, t = _program(N, H, C, D, BC, BD)
    tile_ok = row_ok[:, None] & col_ok[None, :]
    source = ((bh * N + n) * C + rows[:, None]) * D + cols[None, :]
    act = QKV.dtype.element_ty
    channels = h * D + cols
    for part in tl.static_range(3):  # q, k, v
        x = _conved_tile(QKV, HISTORY, CONV_W, b, t, part * H * D + channels, row_ok, col_ok, qkv_stride_b,
                         qkv_stride_t, history_stride_b, history_stride_t, act, TAPS, ROUND, BC, BD)
        if part == 0:
            grad = _head_grad(x, tl.load(DQ + source, mask=tile_ok, other=0.0), QK_NORM, QK_NORM)
        elif part == 1:
            grad = _head_grad(x, tl.load(DK + source, mask=tile_ok, other=0.0), QK_NORM, QK_NORM)
        else:
            grad = _head_grad(x, tl.load(DV + source, mask=tile_ok, other=0.0), VALUE_SILU, False)
        target = D_CONVED + (b * N * C + t[:, None]) * 3 * H * D + part * H * D + channels[None, :]
        tl.store(target, grad, mask=tile_ok)

    logit_rows = LOGITS + b * logit_stride_b + t * logit_stride_t + h
    theta_logit = _gate_logit(logit_rows, BIAS, 0 * H, h, row_ok, act, HAS_BIAS, ROUND)
    eta_logit = _gate_logit(logit_rows, BIAS, 1 * H, h, row_ok, act, HAS_BIAS, ROUND)
    forget_logit = _gate_logit(logit_rows, BIAS, 2 * H, h, row_ok, act, HAS_BIAS, ROUND) + forget_offset
    theta_gate = tl.sigmoid(theta_logit)
    chunk_row = (bh * N + n) * C + rows
    if TOKEN:
        d_weight = tl.load(DTW + chunk_row * 2, mask=row_ok, other=0.0)
        d_momentum = tl.load(DTW + chunk_row * 2 + 1, mask=row_ok, other=0.0)
        d_theta, d_log_eta, d_log_keep = _token_gates_grad(max_lr * theta_gate, eta_logit, forget_logit, rows, row_ok,
                                                           C, d_weight, d_momentum, DDECAYS + (bh * N + n) * 4,
                                                           MOMENTUM, FORGET)
        d_eta = d_log_eta * tl.sigmoid(-eta_logit)
        d_alpha = -d_log_keep * tl.sigmoid(forget_logit)
    else:
        d_theta = 2.0 * tl.load(DTW + chunk_row, mask=row_ok, other=0.0)
        decays = DDECAYS + (bh * N + n) * 2
        eta_gate = tl.sigmoid(eta_logit)
        forget_gate = tl.sigmoid(forget_logit)
        d_eta = tl.load(decays) / C * eta_gate * (1.0 - eta_gate)
        d_alpha = tl.load(decays + 1) / C * forget_gate * (1.0 - forget_gate)
    d_eta = d_eta if MOMENTUM else tl.zeros_like(d_eta)
    d_alpha = d_alpha if FORGET else tl.zeros_like(d_alpha)
    d_rows = D_LOGITS + (b * N * C + t) * 3 * H + h
    tl.store(d_rows, d_theta * max_lr * theta_gate * (1.0 - theta_gate), mask=row_ok)
    tl.store(d_rows + H, d_eta, mask=row_ok)
    tl.store(d_rows + 2 * H, d_alpha, mask=row_ok)


@triton.jit
def _head_grad(x, grad, SILU: tl.constexpr, NORM: tl.constexpr):
    """The gradient to x of <grad, _head_values(x)> (rounding the identity): through the rows' L2
    norm u = s / max(||s||, eps) (grad - u <grad, u> where ||s|| > eps, over the norm) and the SiLU s."""
    if SILU:
        gate = tl.sigmoid(x)
        s = x * gate
        if NORM:
            norm = tl.sqrt(tl.sum(s * s, axis=1))
            scale = tl.maximum(norm, 1e-12)
            u = s / scale[:, None]
            radial = tl.where((norm > 1e-12)[:, None], u * tl.sum(grad * u, axis=1)[:, None], 0.0)
            grad = (grad - radial) / scale[:, None]
        grad = grad * gate * (1.0 + x * (1.0 - gate))
    return grad


@triton.jit
def _token_gates_grad(theta, eta_logit, forget_logit, rows, row_ok, C, d_weight, d_momentum, DDECAYS,
                      MOMENTUM: tl.constexpr, FORGET: tl.constexpr):
    """`_token_gates`' backward for one chunk (kernels/memory_inputs.py `_token_gates_backward` states
    the formulas): from the gradients of TW's two columns and of DECAYS (2, 2), (d theta, d log eta,
    d log(1 - alpha)) over the chunk's rows."""
    to_end, total_keep, lower, products, from_start, to_chunk_end, momentum_end = _gate_products(
        eta_logit, forget_logit, rows, row_ok, C, MOMENTUM, FORGET)
    weighted = to_end[:, None] * products  # [t, i] = R_t P[t, i]
    d_theta = -2.0 * (d_weight * tl.sum(weighted, axis=0) + d_momentum * to_chunk_end)
    q = (-2.0 * theta * d_weight)[None, :] * weighted
    q_start = tl.load(DDECAYS + 1) * to_end * from_start  # the start column
    before = tl.cumsum(q, 1) - q + q_start[:, None]  # [t, j] = sum_{i<j} Q[t, i], the start included
    c_momentum = -2.0 * theta * d_momentum * to_chunk_end
    d_log_eta = tl.sum(tl.where(lower, before, 0.0), axis=0) + tl.cumsum(c_momentum, 0) - c_momentum \
        + tl.load(DDECAYS + 3) * momentum_end
    row_sums = tl.sum(q, axis=1) + q_start
    d_log_keep = tl.cumsum(row_sums, 0) - row_sums + tl.load(DDECAYS) * tl.exp(total_keep)
    return d_theta, d_log_eta, d_log_keep
