"""The fused chunk step of Titans' per-token write rule: a torch reference with a hand-written
backward, and Triton kernels (one forward and one backward launch per chunk).

Titans (arXiv:2501.00663, section 3.2) as restated in the MemoryLlama thesis (section 2.3,
eq. 2.38-2.41): the memory M is a per-head MLP of fast weights written by gradient descent on
the associative loss l(M; k_t, v_t) = ||M(k_t) - v_t||^2 (eq. 2.38),

    S_t = eta_t S_{t-1} - theta_t u_t,   u_t = grad l(M; k_t, v_t)     (eq. 2.39)
    M_t = (1 - alpha_t) M_{t-1} + S_t                                  (eq. 2.40)
    y_t = M*(q_t), read from the state left by the previous chunk        (eq. 2.41)

With every token's gradient taken at the chunk-start weights, a chunk of C tokens unrolls to
one 2 x 2 mix of the stacked state [M; S] plus two weighted sums of per-token gradients
(models/memory/neural_memory.py, module docstring and `chunk_gates`). Per (batch, head) and
weight matrix W_l = state_l[0] (depth 1: W_1 (d, d); depth 2: W_1 (d, h), W_2 (h, d), SiLU
between them; `residual`: M(x) = x + MLP(x)), one chunk step is

    y      = M(q)                                                   (B, H, C, d)   eq. 2.41
    delta  = M(k) - v                                               (B, H, C, d)
    G_l[j] = sum_t token_weights[t, j] (dL_t / dW_l)                 (B, H, 2, in, out), j = 0, 1
             (dL_t / dW_l: the explicit backward of delta_t through the MLP; the squared
              error's 2, theta and the surprise's minus are in token_weights)
    new_l  = mix @ [M_l; S_l] + [G_l[0]; G_l[1]]                     (B, H, 2, in, out) eq. 2.39-2.40

Inputs: q, k, v (B, H, C, d); token_weights (B, H, C, 2); mix (B, H, 2, 2) =
[[R_0, sum_t R_t E_t], [0, E_C]]; state: one (B, H, 2, in, out) tensor per weight matrix, the
stacked [M; S]. Returns (y (B, H, C, d), new state: a tuple like `state`), y and the state in
the state's dtype. The arithmetic runs in the state's dtype (q, k, v, token_weights and mix
are cast to it; autocast off); gradients come back in each input's dtype.

Three implementations, held equal by tests/test_token_kernel.py:

- `token_step_torch`: the forward above in plain torch, differentiated by autograd.
- `token_step_fused_torch` (`FusedTokenStep`): the same forward, with a hand-written backward
  that recomputes the forward's intermediates from the saved inputs (q, k, v, token_weights,
  mix, state): nothing per token is kept between forward and backward. Written apart from
  `chunk_step` (no shared helper), so that it checks it independently.
- `token_step_triton`: one Triton program per (batch, head) holds the chunk and the weights
  as whole tiles: the forward kernel computes y, delta, the explicit backward, both weighted
  sums and the mix in one launch; the backward kernel recomputes the forward and writes the
  gradients of q, k, v, token_weights, mix and the state in one launch. fp32 state; q, k, v,
  token_weights fp32 or bf16 (loaded into fp32); fp32 dots in 3xTF32. Limits (`triton_refusal`):
  depth 1 or 2, head_dim <= MAX_HEAD_DIM (64), hidden width <= MAX_HIDDEN (256), chunk <=
  MAX_CHUNK (64), their padded product <= MAX_TILE_VOLUME (shared memory: head_dim 64 and
  hidden 256 take chunks up to 32), a CUDA device or TRITON_INTERPRET=1. Anything else is refused with a
  ValueError naming the reason, so the caller (`kernels.token_chunk_step`, `chunk_step`)
  can fall back to the torch path. Checked on one H100 (gpu_check `kernels`, docs/benchmarks.md)
  at head_dim 64, hidden 256, chunk 16 and 32 and the smaller shapes; its timing there was
  not clean, so no auto-table entry selects this kernel.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # the torch paths need no triton
    HAVE_TRITON = False

MAX_HEAD_DIM, MAX_HIDDEN, MAX_CHUNK = 64, 256, 64  # the Triton kernels' largest whole tiles
# ... and their largest product of the three padded tiles (head_dim x hidden x chunk): the
# shared memory the kernels ask for grows with it. Measured on an H100 (227 KiB per block,
# Triton 3.6, 2026-11-25): head_dim 64, hidden 256 at chunk 16 needs 98,304 B forward /
# 131,072 B backward, at chunk 32 131,072 / 196,608 B, at chunk 64 266,240 B forward (does not
# launch); (64, 128, 64) and (32, 256, 64) ran. So at most 64 x 256 x 32 = 2^19.
MAX_TILE_VOLUME = 64 * 256 * 32
FP32_DOT_PRECISION = "tf32x3"  # as kernels/triton_kernels.py: about fp32 accuracy on tensor cores


# ---------------------------------------------------------------------------------------------
# torch reference


# The device types that have autocast, looked up once at import: torch 2.11's dynamo cannot
# trace torch.amp.is_autocast_available (it broke the graph there, and the compiled Titans and
# Mela models failed on an H100 image with torch 2.11; docs/benchmarks.md).
AUTOCAST_DEVICE_TYPES = frozenset(t for t in ("cpu", "cuda", "xpu", "mps", "hpu") if torch.amp.is_autocast_available(t))


def full_precision(device: torch.device):
    """Autocast off on `device` (a no-op where autocast does not exist, e.g. meta, or is not on):
    code under it runs in its tensors' own dtype under any autocast (a lower-precision autocast
    would otherwise run a fast-weight update, hence the new state, in bf16). Only an autocast that
    is on is switched off: traced by torch.compile, the switch is a node of the graph, and a graph
    holding one is bypassed by AOTAutograd's cache (torch 2.13), so every launch of an fp32 run
    would trace and partition it again (under bf16 autocast it still is)."""
    if device.type in AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _cast_inputs(state, q, k, v, token_weights, mix):
    dtype = state[0].dtype
    return tuple(t.to(dtype) for t in (q, k, v, token_weights, mix))


def _silu_derivatives(p: torch.Tensor):
    """(silu(p), silu'(p), silu''(p)) with s = sigmoid(p): p s, s (1 + p (1 - s)),
    s (1 - s) (2 + p (1 - 2 s))."""
    s = torch.sigmoid(p)
    return p * s, s * (1 + p * (1 - s)), s * (1 - s) * (2 + p * (1 - 2 * s))


def _forward(weights, q, k, v, token_weights, residual: bool):
    """y, the weighted sums [G_l] (each (B, H, 2, in, out)) and the intermediates the
    backward needs, for weights W_l (B, H, in, out) and inputs in the state dtype."""
    tw = token_weights
    if len(weights) == 1:
        (w1,) = weights
        y, out_k = q @ w1, k @ w1
        if residual:
            y, out_k = y + q, out_k + k
        delta = out_k - v
        return y, (torch.einsum("bhtj,bhti,bhto->bhjio", tw, k, delta),), {"delta": delta}
    w1, w2 = weights
    pre_q, pre_k = q @ w1, k @ w1
    act_q, d1_q, _ = _silu_derivatives(pre_q)
    act_k, d1_k, d2_k = _silu_derivatives(pre_k)
    y, out_k = act_q @ w2, act_k @ w2
    if residual:
        y, out_k = y + q, out_k + k
    delta2 = out_k - v  # the error at the output, (B, H, C, d)
    err1 = delta2 @ w2.transpose(-1, -2)  # back through W_2, (B, H, C, h)
    delta1 = err1 * d1_k  # back through the SiLU
    grads = (torch.einsum("bhtj,bhti,bhto->bhjio", tw, k, delta1), torch.einsum("bhtj,bhti,bhto->bhjio", tw, act_k, delta2))
    saved = {"act_q": act_q, "d1_q": d1_q, "act_k": act_k, "d1_k": d1_k, "d2_k": d2_k, "delta2": delta2, "err1": err1,
             "delta1": delta1}
    return y, grads, saved


def _mix(state, mix, grads):
    return tuple(torch.einsum("bhij,bhjxy->bhixy", mix, s) + g for s, g in zip(state, grads))


def token_step_torch(state, q, k, v, token_weights, mix, residual: bool = False):
    """The fused step's forward in plain torch, differentiated by autograd (module docstring)."""
    with full_precision(q.device):
        q, k, v, token_weights, mix = _cast_inputs(state, q, k, v, token_weights, mix)
        y, grads, _ = _forward([s[:, :, 0] for s in state], q, k, v, token_weights, residual)
        return y, _mix(state, mix, grads)


def _backward(state, q, k, v, tw, mix, residual: bool, dy, dnew):
    """Gradients of (y, new state) back to (q, k, v, token_weights, mix, state), recomputing
    the forward (all in the state dtype). dy (B, H, C, d); dnew per matrix (B, H, 2, in, out)."""
    weights = [s[:, :, 0] for s in state]
    y, grads, saved = _forward(weights, q, k, v, tw, residual)
    # new_l = mix [M_l; S_l] + G_l: to the stacked state, the mix, and G_l
    dstate = [torch.einsum("bhij,bhixy->bhjxy", mix, dn) for dn in dnew]
    dmix = sum(torch.einsum("bhixy,bhjxy->bhij", dn, s) for dn, s in zip(dnew, state))
    dg = dnew  # dL/dG_l[j]: (B, H, 2, in, out)
    if len(weights) == 1:
        (w1,) = weights
        delta = saved["delta"]
        # G_1[j] = sum_t tw[t, j] k_t delta_t^T
        through_k = torch.einsum("bhti,bhjio->bhtjo", k, dg[0])  # k_t^T dG[j], (B, H, C, 2, d)
        d_delta = torch.einsum("bhtj,bhtjo->bhto", tw, through_k)
        d_tw = torch.einsum("bhtjo,bhto->bhtj", through_k, delta)
        d_k = torch.einsum("bhtj,bhjio,bhto->bhti", tw, dg[0], delta)
        d_out_k, d_v = d_delta, -d_delta
        d_w1 = q.transpose(-1, -2) @ dy + k.transpose(-1, -2) @ d_out_k
        d_q = dy @ w1.transpose(-1, -2)
        d_k = d_k + d_out_k @ w1.transpose(-1, -2)
        if residual:
            d_q, d_k = d_q + dy, d_k + d_out_k
        d_weights = [d_w1]
    else:
        w1, w2 = weights
        act_q, d1_q, act_k, d1_k, d2_k = (saved[n] for n in ("act_q", "d1_q", "act_k", "d1_k", "d2_k"))
        delta2, err1, delta1 = saved["delta2"], saved["err1"], saved["delta1"]
        # G_2[j] = sum_t tw[t, j] act_k_t delta2_t^T
        through_a = torch.einsum("bhta,bhjao->bhtjo", act_k, dg[1])  # (B, H, C, 2, d)
        d_delta2 = torch.einsum("bhtj,bhtjo->bhto", tw, through_a)
        d_tw = torch.einsum("bhtjo,bhto->bhtj", through_a, delta2)
        d_act_k = torch.einsum("bhtj,bhjao,bhto->bhta", tw, dg[1], delta2)
        # G_1[j] = sum_t tw[t, j] k_t delta1_t^T
        through_k = torch.einsum("bhti,bhjia->bhtja", k, dg[0])  # (B, H, C, 2, h)
        d_delta1 = torch.einsum("bhtj,bhtja->bhta", tw, through_k)
        d_tw = d_tw + torch.einsum("bhtja,bhta->bhtj", through_k, delta1)
        d_k = torch.einsum("bhtj,bhjia,bhta->bhti", tw, dg[0], delta1)
        # delta1 = err1 silu'(pre_k), err1 = delta2 W_2^T
        d_err1 = d_delta1 * d1_k
        d_pre_k = d_delta1 * err1 * d2_k
        d_delta2 = d_delta2 + d_err1 @ w2
        d_w2 = d_err1.transpose(-1, -2) @ delta2
        # delta2 = out_k - v; y = act_q W_2 (+ q), out_k = act_k W_2 (+ k)
        d_out_k, d_v = d_delta2, -d_delta2
        d_w2 = d_w2 + act_q.transpose(-1, -2) @ dy + act_k.transpose(-1, -2) @ d_out_k
        d_pre_q = (dy @ w2.transpose(-1, -2)) * d1_q
        d_pre_k = d_pre_k + (d_act_k + d_out_k @ w2.transpose(-1, -2)) * d1_k
        d_w1 = q.transpose(-1, -2) @ d_pre_q + k.transpose(-1, -2) @ d_pre_k
        d_q = d_pre_q @ w1.transpose(-1, -2)
        d_k = d_k + d_pre_k @ w1.transpose(-1, -2)
        if residual:
            d_q, d_k = d_q + dy, d_k + d_out_k
        d_weights = [d_w1, d_w2]
    for ds, dw in zip(dstate, d_weights):
        ds[:, :, 0] += dw
    return d_q, d_k, d_v, d_tw, dmix, dstate


class FusedTokenStep(torch.autograd.Function):
    """The fused step in torch with a hand-written backward (module docstring). apply(q, k, v,
    token_weights, mix, residual, *state) -> (y, *new state). Saves only its inputs."""

    @staticmethod
    def forward(ctx, q, k, v, token_weights, mix, residual, *state):
        ctx.residual = residual
        ctx.save_for_backward(q, k, v, token_weights, mix, *state)
        with full_precision(q.device):
            cast = _cast_inputs(state, q, k, v, token_weights, mix)
            y, grads, _ = _forward([s[:, :, 0] for s in state], *cast[:4], residual)
            return (y, *_mix(state, cast[4], grads))

    @staticmethod
    def backward(ctx, dy, *dnew):
        q, k, v, tw, mix, *state = ctx.saved_tensors
        with full_precision(q.device):
            cast = _cast_inputs(state, q, k, v, tw, mix)
            d_q, d_k, d_v, d_tw, d_mix, d_state = _backward(state, *cast, ctx.residual, dy.to(state[0].dtype),
                                                              [d.to(state[0].dtype) for d in dnew])
        like = (q, k, v, tw, mix)
        return (*(g.to(t.dtype) for g, t in zip((d_q, d_k, d_v, d_tw, d_mix), like)), None, *d_state)


def token_step_fused_torch(state, q, k, v, token_weights, mix, residual: bool = False):
    """The fused step through `FusedTokenStep` (module docstring); depth 1 or 2."""
    if len(state) not in (1, 2):
        raise ValueError(f"token_step_fused_torch: depth {len(state)} unsupported (1 or 2)")
    y, *new = FusedTokenStep.apply(q, k, v, token_weights, mix, residual, *state)
    return y, tuple(new)


# ---------------------------------------------------------------------------------------------
# Triton


def triton_refusal(state, q, k=None, v=None, token_weights=None, mix=None) -> str | None:
    """Why the Triton kernels cannot take this step (None when they can)."""
    if not HAVE_TRITON:
        return "triton is not installed"
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the inputs are on {q.device}: the Triton kernels need a CUDA device (or TRITON_INTERPRET=1)"
    if len(state) not in (1, 2):
        return f"depth {len(state)}: the Triton kernels take depth 1 or 2"
    batch, heads, chunk, dim = q.shape
    if any(s.dtype != torch.float32 for s in state) or (mix is not None and mix.dtype != torch.float32):
        return f"state dtype {state[0].dtype}: the Triton kernels take a float32 state (and float32 mix)"
    inputs = [t for t in (q, k, v, token_weights) if t is not None]
    if any(t.dtype not in (torch.float32, torch.bfloat16) for t in inputs):
        return f"input dtypes {[t.dtype for t in inputs]}: the Triton kernels take float32 or bfloat16"
    if any(t.device != state[0].device for t in inputs):
        return "inputs and state on different devices"
    hidden = state[0].shape[-1]
    if dim > MAX_HEAD_DIM or hidden > MAX_HIDDEN or chunk > MAX_CHUNK:
        return (f"head_dim {dim}, hidden {hidden}, chunk {chunk}: the Triton kernels take head_dim <= {MAX_HEAD_DIM}, "
                f"hidden <= {MAX_HIDDEN}, chunk <= {MAX_CHUNK}")
    volume = math.prod(max(16, 1 << (n - 1).bit_length()) for n in (dim, hidden, chunk))  # as `_geometry` pads
    if volume > MAX_TILE_VOLUME:
        return (f"head_dim {dim} x hidden {hidden} x chunk {chunk} (padded {volume:,}): the Triton kernels' tiles "
                f"would need more shared memory than an H100 block has (at most {MAX_TILE_VOLUME:,}: lower the chunk)")
    expected = [(batch, heads, 2, dim, hidden)] + ([(batch, heads, 2, hidden, dim)] if len(state) == 2 else [])
    if len(state) == 1 and hidden != dim:
        return f"depth 1 needs a square weight, got {tuple(state[0].shape[-2:])}"
    if [tuple(s.shape) for s in state] != expected:
        return f"state shapes {[tuple(s.shape) for s in state]}; expected {expected}"
    for name, t, shape in (("k", k, q.shape), ("v", v, q.shape), ("token_weights", token_weights, (batch, heads, chunk, 2)),
                           ("mix", mix, (batch, heads, 2, 2))):
        if t is not None and tuple(t.shape) != tuple(shape):
            return f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}"
    return None


if HAVE_TRITON:
    FP32_DOT = tl.constexpr(FP32_DOT_PRECISION)

    @triton.jit
    def _tile(ptr, rows, cols, n_rows, n_cols, row_stride):
        """The (len(rows), len(cols)) fp32 tile of a row-major matrix, zero outside it."""
        inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        return tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)

    @triton.jit
    def _put(ptr, value, rows, cols, n_rows, n_cols, row_stride):
        inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        tl.store(ptr + rows[:, None] * row_stride + cols[None, :], value.to(ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _chunk_inputs(q_ptr, k_ptr, v_ptr, tw_ptr, mix_ptr, pid, rc, rd, C, D):
        """Program `pid`'s (batch, head) chunk in fp32: q, k, v (C, D) tiles, the two token
        weightings (C,) and the four mix entries m00, m01, m10, m11."""
        q = _tile(q_ptr + pid * C * D, rc, rd, C, D, D)
        k = _tile(k_ptr + pid * C * D, rc, rd, C, D, D)
        v = _tile(v_ptr + pid * C * D, rc, rd, C, D, D)
        tw0 = tl.load(tw_ptr + pid * C * 2 + rc * 2, mask=rc < C, other=0.0).to(tl.float32)
        tw1 = tl.load(tw_ptr + pid * C * 2 + rc * 2 + 1, mask=rc < C, other=0.0).to(tl.float32)
        m00 = tl.load(mix_ptr + pid * 4).to(tl.float32)
        m01 = tl.load(mix_ptr + pid * 4 + 1).to(tl.float32)
        m10 = tl.load(mix_ptr + pid * 4 + 2).to(tl.float32)
        m11 = tl.load(mix_ptr + pid * 4 + 3).to(tl.float32)
        return q, k, v, tw0, tw1, m00, m01, m10, m11

    @triton.jit
    def _weighted_sum_grads(x, delta, dg0, dg1, tw0, tw1):
        """Backward of one layer's weighted gradient sums G[j] = sum_t tw[t, j] x_t delta_t^T
        (x (C, in), delta (C, out), tw0 / tw1 (C,)) from their gradients dg0, dg1 (in, out):
        (d delta (C, out), d tw0 (C,), d tw1 (C,), d x (C, in))."""
        through0 = tl.dot(x, dg0, input_precision=FP32_DOT)
        through1 = tl.dot(x, dg1, input_precision=FP32_DOT)
        d_delta = tw0[:, None] * through0 + tw1[:, None] * through1
        d_x = (tw0[:, None] * tl.dot(delta, tl.trans(dg0), input_precision=FP32_DOT)
               + tw1[:, None] * tl.dot(delta, tl.trans(dg1), input_precision=FP32_DOT))
        return d_delta, tl.sum(through0 * delta, axis=1), tl.sum(through1 * delta, axis=1), d_x

    @triton.jit
    def _token_step_fwd(q_ptr, k_ptr, v_ptr, tw_ptr, mix_ptr, s1_ptr, s2_ptr, y_ptr, n1_ptr, n2_ptr, C, D, N,
                        DEPTH: tl.constexpr, RESIDUAL: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
                        BN: tl.constexpr):
        """One (batch, head): q, k, v (C, D), tw (C, 2), mix (2, 2), s1 (2, D, N), s2 (2, N, D)
        (depth 2; N = hidden, N = D at depth 1) -> y (C, D), n1, n2 (the new stacked states)."""
        pid = tl.program_id(0).to(tl.int64)
        rc, rd, rn = tl.arange(0, BC), tl.arange(0, BD), tl.arange(0, BN)
        q, k, v, tw0, tw1, m00, m01, m10, m11 = _chunk_inputs(q_ptr, k_ptr, v_ptr, tw_ptr, mix_ptr, pid, rc, rd, C, D)
        s1 = s1_ptr + pid * 2 * D * N
        w1 = _tile(s1, rd, rn, D, N, N)
        if DEPTH == 1:
            y = tl.dot(q, w1, input_precision=FP32_DOT)
            out_k = tl.dot(k, w1, input_precision=FP32_DOT)
            if RESIDUAL:
                y += q
                out_k += k
            delta1 = out_k - v
        else:
            s2 = s2_ptr + pid * 2 * N * D
            w2 = _tile(s2, rn, rd, N, D, D)
            pre_q = tl.dot(q, w1, input_precision=FP32_DOT)
            y = tl.dot(pre_q * tl.sigmoid(pre_q), w2, input_precision=FP32_DOT)
            pre_k = tl.dot(k, w1, input_precision=FP32_DOT)
            sig_k = tl.sigmoid(pre_k)
            act_k = pre_k * sig_k
            out_k = tl.dot(act_k, w2, input_precision=FP32_DOT)
            if RESIDUAL:
                y += q
                out_k += k
            delta2 = out_k - v
            delta1 = tl.dot(delta2, tl.trans(w2), input_precision=FP32_DOT) * (sig_k * (1 + pre_k * (1 - sig_k)))
            g0 = tl.dot(tl.trans(act_k * tw0[:, None]), delta2, input_precision=FP32_DOT)
            g1 = tl.dot(tl.trans(act_k * tw1[:, None]), delta2, input_precision=FP32_DOT)
            m2 = w2
            s2_old = _tile(s2 + N * D, rn, rd, N, D, D)
            n2 = n2_ptr + pid * 2 * N * D
            _put(n2, m00 * m2 + m01 * s2_old + g0, rn, rd, N, D, D)
            _put(n2 + N * D, m10 * m2 + m11 * s2_old + g1, rn, rd, N, D, D)
        _put(y_ptr + pid * C * D, y, rc, rd, C, D, D)
        g0 = tl.dot(tl.trans(k * tw0[:, None]), delta1, input_precision=FP32_DOT)
        g1 = tl.dot(tl.trans(k * tw1[:, None]), delta1, input_precision=FP32_DOT)
        s1_old = _tile(s1 + D * N, rd, rn, D, N, N)
        n1 = n1_ptr + pid * 2 * D * N
        _put(n1, m00 * w1 + m01 * s1_old + g0, rd, rn, D, N, N)
        _put(n1 + D * N, m10 * w1 + m11 * s1_old + g1, rd, rn, D, N, N)

    @triton.jit
    def _token_step_bwd(q_ptr, k_ptr, v_ptr, tw_ptr, mix_ptr, s1_ptr, s2_ptr, dy_ptr, dn1_ptr, dn2_ptr,
                        dq_ptr, dk_ptr, dv_ptr, dtw_ptr, dmix_ptr, ds1_ptr, ds2_ptr, C, D, N,
                        DEPTH: tl.constexpr, RESIDUAL: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
                        BN: tl.constexpr):
        """One (batch, head): recomputes the forward from its inputs, then the gradients of
        (y, n1, n2) (dy (C, D), dn1 (2, D, N), dn2 (2, N, D)) back to q, k, v (C, D), tw (C, 2),
        mix (2, 2), s1 (2, D, N), s2 (2, N, D), all written in fp32."""
        pid = tl.program_id(0).to(tl.int64)
        rc, rd, rn = tl.arange(0, BC), tl.arange(0, BD), tl.arange(0, BN)
        q, k, v, tw0, tw1, m00, m01, m10, m11 = _chunk_inputs(q_ptr, k_ptr, v_ptr, tw_ptr, mix_ptr, pid, rc, rd, C, D)
        dy = _tile(dy_ptr + pid * C * D, rc, rd, C, D, D)
        s1 = s1_ptr + pid * 2 * D * N
        w1 = _tile(s1, rd, rn, D, N, N)
        s1_old = _tile(s1 + D * N, rd, rn, D, N, N)
        dn1 = dn1_ptr + pid * 2 * D * N
        dg1_0 = _tile(dn1, rd, rn, D, N, N)  # dL/dG_1[0] = dL/dnew_1[0]
        dg1_1 = _tile(dn1 + D * N, rd, rn, D, N, N)
        # the mix: new[i] = m[i, 0] M + m[i, 1] S + G[i]
        dm00 = tl.sum(tl.sum(dg1_0 * w1, axis=1), axis=0)
        dm01 = tl.sum(tl.sum(dg1_0 * s1_old, axis=1), axis=0)
        dm10 = tl.sum(tl.sum(dg1_1 * w1, axis=1), axis=0)
        dm11 = tl.sum(tl.sum(dg1_1 * s1_old, axis=1), axis=0)
        ds1 = ds1_ptr + pid * 2 * D * N
        _put(ds1 + D * N, m01 * dg1_0 + m11 * dg1_1, rd, rn, D, N, N)
        dw1_mix = m00 * dg1_0 + m10 * dg1_1
        if DEPTH == 1:
            out_k = tl.dot(k, w1, input_precision=FP32_DOT)
            if RESIDUAL:
                out_k += k
            delta = out_k - v
            # G_1[j] = sum_t tw[t, j] k_t delta_t^T
            d_out_k, dtw0, dtw1, dk = _weighted_sum_grads(k, delta, dg1_0, dg1_1, tw0, tw1)
            dw1 = (tl.dot(tl.trans(q), dy, input_precision=FP32_DOT)
                   + tl.dot(tl.trans(k), d_out_k, input_precision=FP32_DOT))
            dq = tl.dot(dy, tl.trans(w1), input_precision=FP32_DOT)
            dk += tl.dot(d_out_k, tl.trans(w1), input_precision=FP32_DOT)
        else:
            s2 = s2_ptr + pid * 2 * N * D
            w2 = _tile(s2, rn, rd, N, D, D)
            s2_old = _tile(s2 + N * D, rn, rd, N, D, D)
            dn2 = dn2_ptr + pid * 2 * N * D
            dg2_0 = _tile(dn2, rn, rd, N, D, D)
            dg2_1 = _tile(dn2 + N * D, rn, rd, N, D, D)
            dm00 += tl.sum(tl.sum(dg2_0 * w2, axis=1), axis=0)
            dm01 += tl.sum(tl.sum(dg2_0 * s2_old, axis=1), axis=0)
            dm10 += tl.sum(tl.sum(dg2_1 * w2, axis=1), axis=0)
            dm11 += tl.sum(tl.sum(dg2_1 * s2_old, axis=1), axis=0)
            ds2 = ds2_ptr + pid * 2 * N * D
            _put(ds2 + N * D, m01 * dg2_0 + m11 * dg2_1, rn, rd, N, D, D)
            # recompute the forward
            pre_q = tl.dot(q, w1, input_precision=FP32_DOT)
            sig_q = tl.sigmoid(pre_q)
            act_q = pre_q * sig_q
            d1_q = sig_q * (1 + pre_q * (1 - sig_q))
            pre_k = tl.dot(k, w1, input_precision=FP32_DOT)
            sig_k = tl.sigmoid(pre_k)
            act_k = pre_k * sig_k
            d1_k = sig_k * (1 + pre_k * (1 - sig_k))
            d2_k = sig_k * (1 - sig_k) * (2 + pre_k * (1 - 2 * sig_k))
            out_k = tl.dot(act_k, w2, input_precision=FP32_DOT)
            if RESIDUAL:
                out_k += k
            delta2 = out_k - v
            err1 = tl.dot(delta2, tl.trans(w2), input_precision=FP32_DOT)
            delta1 = err1 * d1_k
            # G_2[j] = sum_t tw[t, j] act_k_t delta2_t^T
            d_delta2, dtw0, dtw1, d_act_k = _weighted_sum_grads(act_k, delta2, dg2_0, dg2_1, tw0, tw1)
            # G_1[j] = sum_t tw[t, j] k_t delta1_t^T
            d_delta1, dtw0_1, dtw1_1, dk = _weighted_sum_grads(k, delta1, dg1_0, dg1_1, tw0, tw1)
            dtw0 += dtw0_1
            dtw1 += dtw1_1
            # delta1 = err1 silu'(pre_k), err1 = delta2 W_2^T
            d_err1 = d_delta1 * d1_k
            d_pre_k = d_delta1 * err1 * d2_k
            d_delta2 += tl.dot(d_err1, w2, input_precision=FP32_DOT)
            d_out_k = d_delta2
            dw2 = (tl.dot(tl.trans(d_err1), delta2, input_precision=FP32_DOT)
                   + tl.dot(tl.trans(act_q), dy, input_precision=FP32_DOT)
                   + tl.dot(tl.trans(act_k), d_out_k, input_precision=FP32_DOT))
            _put(ds2, m00 * dg2_0 + m10 * dg2_1 + dw2, rn, rd, N, D, D)
            d_pre_q = tl.dot(dy, tl.trans(w2), input_precision=FP32_DOT) * d1_q
            d_pre_k += (d_act_k + tl.dot(d_out_k, tl.trans(w2), input_precision=FP32_DOT)) * d1_k
            dw1 = (tl.dot(tl.trans(q), d_pre_q, input_precision=FP32_DOT)
                   + tl.dot(tl.trans(k), d_pre_k, input_precision=FP32_DOT))
            dq = tl.dot(d_pre_q, tl.trans(w1), input_precision=FP32_DOT)
            dk += tl.dot(d_pre_k, tl.trans(w1), input_precision=FP32_DOT)
        if RESIDUAL:
            dq += dy
            dk += d_out_k
        _put(ds1, dw1_mix + dw1, rd, rn, D, N, N)
        _put(dq_ptr + pid * C * D, dq, rc, rd, C, D, D)
        _put(dk_ptr + pid * C * D, dk, rc, rd, C, D, D)
        _put(dv_ptr + pid * C * D, -d_out_k, rc, rd, C, D, D)
        tl.store(dtw_ptr + pid * C * 2 + rc * 2, dtw0, mask=rc < C)
        tl.store(dtw_ptr + pid * C * 2 + rc * 2 + 1, dtw1, mask=rc < C)
        tl.store(dmix_ptr + pid * 4, dm00)
        tl.store(dmix_ptr + pid * 4 + 1, dm01)
        tl.store(dmix_ptr + pid * 4 + 2, dm10)
        tl.store(dmix_ptr + pid * 4 + 3, dm11)


def _geometry(state, q):
    """(grid, (C, D, N), constexpr launch options) of one program per (batch, head)."""
    batch, heads, chunk, dim = q.shape
    hidden = state[0].shape[-1]
    blocks = {"DEPTH": len(state), "BC": max(16, triton.next_power_of_2(chunk)),
              "BD": max(16, triton.next_power_of_2(dim)), "BN": max(16, triton.next_power_of_2(hidden)),
              "num_warps": 8 if hidden > 64 else 4}
    return (batch * heads,), (chunk, dim, hidden), blocks


class _TritonTokenStep(torch.autograd.Function):
    """apply(q, k, v, token_weights, mix, residual, *state) -> (y, *new state): the forward
    kernel, and a backward kernel that recomputes the forward (only the inputs are saved)."""

    @staticmethod
    def forward(ctx, q, k, v, token_weights, mix, residual, *state):
        q, k, v, token_weights = (t.contiguous() for t in (q, k, v, token_weights))
        mix = mix.contiguous()
        state = tuple(s.contiguous() for s in state)
        ctx.residual = residual
        ctx.save_for_backward(q, k, v, token_weights, mix, *state)
        grid, sizes, blocks = _geometry(state, q)
        y = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        new = tuple(torch.empty_like(s) for s in state)
        _token_step_fwd[grid](q, k, v, token_weights, mix, state[0], state[-1], y, new[0], new[-1], *sizes,
                              RESIDUAL=bool(residual), **blocks)
        return (y, *new)

    @staticmethod
    def backward(ctx, dy, *dnew):
        q, k, v, tw, mix, *state = ctx.saved_tensors
        dy = dy.to(torch.float32).contiguous()
        dnew = tuple(d.to(torch.float32).contiguous() for d in dnew)
        grid, sizes, blocks = _geometry(state, q)
        dq, dk, dv = (torch.empty(q.shape, dtype=torch.float32, device=q.device) for _ in range(3))
        dtw = torch.empty(tw.shape, dtype=torch.float32, device=q.device)
        dmix = torch.empty(mix.shape, dtype=torch.float32, device=q.device)
        dstate = tuple(torch.empty_like(s) for s in state)
        _token_step_bwd[grid](q, k, v, tw, mix, state[0], state[-1], dy, dnew[0], dnew[-1], dq, dk, dv, dtw, dmix,
                              dstate[0], dstate[-1], *sizes, RESIDUAL=bool(ctx.residual), **blocks)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dtw.to(tw.dtype), dmix, None, *dstate)


def token_step_triton(state, q, k, v, token_weights, mix, residual: bool = False):
    """The fused step by the Triton kernels (module docstring): ValueError naming the reason
    for a step they cannot take (`triton_refusal`)."""
    reason = triton_refusal(state, q, k, v, token_weights, mix)
    if reason is not None:
        raise ValueError(f"token_step_triton: {reason}; use backend 'torch' or 'fused_torch'")
    y, *new = _TritonTokenStep.apply(q, k, v, token_weights, mix, residual, *state)
    return y, tuple(new)
