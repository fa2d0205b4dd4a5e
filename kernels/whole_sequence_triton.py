"""Triton kernels of the whole-sequence memory path (kernels/whole_sequence.py states the
rules and holds the torch reference): one forward and one backward launch per layer and
training step, whatever the sequence length. One program per (batch, head) walks the
sequence's N chunks in order (forward) or in reverse (backward).

Why it fits the paper memory shapes (head_dim 64, hidden 256, chunk 64), which the per-chunk
kernel (kernels/token_step.py) refuses: no program holds a whole weight matrix. Every pass
over the fast weights walks the hidden width in blocks of BH (16: `whole_sequence.HIDDEN_BLOCK`)
columns of W_1 (D, HD) and the matching rows of W_2 (HD, D); what spans the hidden width is a
sum over blocks (the memory's output, the error's gradient, Newton-Schulz's D x D Gram matrix,
the surprise bound's norms) kept in registers. Registers, not shared memory, bound the blocks:
at the paper shape with bf16 products BH 64 spilled (`scripts/compile_kernels.py` reads ptxas's
report), so the backward keeps only k, the error, its gradient and dk across a pass, reads q
and dy in a pass of their own (`_read_backward`), and accumulates in the products' own
registers (`_dot_add`). What still spills (ptxas's spill instructions mapped to source lines
with `nvdisasm -g`): mostly values the compiler hoists out of the chunk loop, the address and
mask tiles of each load pattern, spilled once at the start and reloaded in the loops; in the
Newton-Schulz backward also its four D x D fp32 matrices (the Gram matrix, its polynomial and
their gradients, 16 registers each per thread at 8 warps). 16 warps (128 registers a thread)
and hidden blocks of 32 spilled more.
The state lives in global memory (L2 on an H100: 256 KiB per head at the paper shape):

- forward: chunk c reads the state entering it and writes the next; every G-th state is kept,
  ck[g] (B*H, ceil(N / G) + 1, 2, in, out) holds [M; S] entering chunk g G and ck[-1] the
  final state; the states between live in a group buffer seg (B*H, G, 2, in, out);
- backward: group by group from the last, the group's states are recomputed from its
  checkpoint into seg, then its chunks run backward, each recomputing its own forward from the
  state entering it (and the state it wrote, where the read follows the write or Newton-Schulz
  is differentiated); the state's gradient is updated in place, from the final state's back
  to the initial state's. G = 1 keeps every state and recomputes none.

The surprise bound (LIMITED; kernels/whole_sequence.py): the forward stores a chunk's sums G_m
in the new state's slots while it sums their squares over the hidden blocks, then rewrites
them as the rule's update with G_m scaled; the scales go to a (B*H, N, 2, 2) buffer that the
backward reads as constants.

Newton-Schulz (NS_STEPS > 0) works on the wide view (D, HD) of each matrix (W_2 read
transposed through its strides: NS(X^T) = NS(X)^T); its iterates go to a scratch buffer,
(B*H, 2, NS_STEPS, D, HD) in the backward. A barrier separates every pass that writes a
buffer from the next pass that reads it (one program is one block of threads).

The products (`_dot`) take fp32 operands on the FMA units ("ieee": fp32 exactly, for checks
and fp32 training), or with BF16 bf16 operands, as bf16 autocast runs the chunk loop's
fast-weight matmuls (the state, its update and every accumulation stay fp32): on the tensor
cores (BF16 1) through wgmma where Triton's ptxas is safe for it, by default on Hopper, or through
mma.sync on request (kernels/ptxas.py: the wgmma form crashed and gave wrong values on an H200
with Triton 3.6 and its ptxas 12.8, and matched the reference there with ptxas 13.5), else
(BF16 2, and under TRITON_INTERPRET=1, whose bf16 dot is wrong) as bf16-rounded operands on the
FMA units, the same values. Not TF32
(tf32x3): its split operands need more shared memory than an H100 block has. Shared memory of each kernel at
the paper shape, compiled for sm_90 without a GPU (`scripts/compile_kernels.py`), is in
docs/benchmarks.md; launches use num_stages=1 (the hidden-block loops are not pipelined: the
pipeline's copies of the state blocks would not fit).
"""

from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def _load(ptr, rows, cols, n_rows, n_cols, stride_r, stride_c):
    """The (len(rows), len(cols)) fp32 tile at ptr[rows * stride_r + cols * stride_c], 0 outside."""
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=inside, other=0.0).to(tl.float32)


@triton.jit
def _store(ptr, value, rows, cols, n_rows, n_cols, stride_r, stride_c):
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, value.to(ptr.dtype.element_ty), mask=inside)


@triton.jit
def _dot_add(acc, a, b, BF16: tl.constexpr):
    """acc + a @ b accumulated in fp32 (acc None: 0), in the product's own accumulator. BF16
    (`whole_sequence.products`): 0, fp32 operands on the FMA units ("ieee": fp32 exactly);
    1, bf16 operands on the tensor cores (what bf16 autocast gives the chunk loop's fast-weight
    matmuls); 2, the same values on the FMA units, the operands rounded to bf16 first (a product
    of two bf16 values is exact in fp32)."""
    if BF16 == 1:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif BF16 == 2:
        out = tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision="ieee")
    return out


@triton.jit
def _dot(a, b, BF16: tl.constexpr):
    """a @ b (`_dot_add`)."""
    return _dot_add(None, a, b, BF16)


@triton.jit
def _silu_parts(pre):
    """(silu(pre), silu'(pre), silu''(pre)). Callers name every part, even unused ones: Triton
    refused a loop-carried `_` reassigned in a loop (the NS forward); the compiler drops the
    parts nobody reads."""
    sig = tl.sigmoid(pre)
    return pre * sig, sig * (1 + pre * (1 - sig)), sig * (1 - sig) * (2 + pre * (1 - 2 * sig))


@triton.jit
def _token_weight(tw_ptr, row, C, K, m, rc):
    """Weighting m of the (C,) token weights of chunk `row` of a (rows, C, K) tensor."""
    return tl.load(tw_ptr + row * C * K + rc * K + m, mask=rc < C, other=0.0).to(tl.float32)


@triton.jit
def _mlp(x, w1_ptr, w2_ptr, D, HD, rd, rh, BH: tl.constexpr, BF16: tl.constexpr):
    """M(x) = silu(x W_1) W_2 for x (BC, BD); W_1 (D, HD), W_2 (HD, D) row-major."""
    out = tl.zeros_like(x)
    for h0 in range(0, HD, BH):
        w1 = _load(w1_ptr + h0, rd, rh, D, HD - h0, HD, 1)
        w2 = _load(w2_ptr + h0 * D, rh, rd, HD - h0, D, D, 1)
        act, d1, d2 = _silu_parts(_dot(x, w1, BF16))
        out = _dot_add(out, act, w2, BF16)
    return out


@triton.jit
def _read_backward(q_ptr, dy_ptr, dq_ptr, row, w1_ptr, w2_ptr, dw1_ptr, dw2_ptr, C, D, HD, rc, rd, rh,
                   RESIDUAL: tl.constexpr, BH: tl.constexpr, BF16: tl.constexpr):
    """Backward of chunk `row`'s read y = silu(q W_1) W_2 (+ q with RESIDUAL), q, dy, dq
    (rows, C, D): writes dq and adds dW_1, dW_2 in place to dw1_ptr (D, HD), dw2_ptr (HD, D)."""
    q = _load(q_ptr + row * C * D, rc, rd, C, D, D, 1)
    dy = _load(dy_ptr + row * C * D, rc, rd, C, D, D, 1)
    dq = tl.zeros_like(q)
    for h0 in range(0, HD, BH):
        w1 = _load(w1_ptr + h0, rd, rh, D, HD - h0, HD, 1)
        w2 = _load(w2_ptr + h0 * D, rh, rd, HD - h0, D, D, 1)
        act, d1, d2 = _silu_parts(_dot(q, w1, BF16))
        d_pre = _dot(dy, tl.trans(w2), BF16) * d1
        dq = _dot_add(dq, d_pre, tl.trans(w1), BF16)
        dw1 = _load(dw1_ptr + h0, rd, rh, D, HD - h0, HD, 1) + _dot(tl.trans(q), d_pre, BF16)
        dw2 = _load(dw2_ptr + h0 * D, rh, rd, HD - h0, D, D, 1) + _dot(tl.trans(act), dy, BF16)
        _store(dw1_ptr + h0, dw1, rd, rh, D, HD - h0, HD, 1)
        _store(dw2_ptr + h0 * D, dw2, rh, rd, HD - h0, D, D, 1)
    if RESIDUAL:
        dq += dy
    _store(dq_ptr + row * C * D, dq, rc, rd, C, D, D, 1)


@triton.jit
def _ns_poly(gram, B_COEF: tl.constexpr, C_COEF: tl.constexpr, BF16: tl.constexpr):
    """b A + c A^2 for the Gram matrix A (BD, BD), as c (b / c A + A A): the product in its own
    accumulator (`_dot_add`)."""
    return C_COEF * _dot_add((B_COEF / C_COEF) * gram, gram, gram, BF16)


@triton.jit(noinline=True)
def _ns_forward(src_ptr, src_sd, src_sh, x_ptr, D, HD, NS_STEPS: tl.constexpr, A_COEF: tl.constexpr,
                B_COEF: tl.constexpr, C_COEF: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BF16: tl.constexpr):
    """x (D, HD) row-major <- NewtonSchulz(src), src the (D, HD) view src_ptr[d * src_sd + h * src_sh]
    (not inlined: `_ns_backward`):
    X = src / (||src||_F + 1e-7), then NS_STEPS of X = a X + (b A + c A^2) X, A = X X^T."""
    rd, rh = tl.arange(0, BD), tl.arange(0, BH)
    squares = 0.0
    for h0 in range(0, HD, BH):
        block = _load(src_ptr + h0 * src_sh, rd, rh, D, HD - h0, src_sd, src_sh)
        squares += _inner(block, block)
    scale = 1.0 / (tl.sqrt(squares) + 1e-7)
    for h0 in range(0, HD, BH):
        block = _load(src_ptr + h0 * src_sh, rd, rh, D, HD - h0, src_sd, src_sh)
        _store(x_ptr + h0, block * scale, rd, rh, D, HD - h0, HD, 1)
    tl.debug_barrier()
    for _ in tl.static_range(NS_STEPS):
        gram = tl.zeros((BD, BD), dtype=tl.float32)
        for h0 in range(0, HD, BH):
            block = _load(x_ptr + h0, rd, rh, D, HD - h0, HD, 1)
            gram = _dot_add(gram, block, tl.trans(block), BF16)
        poly = _ns_poly(gram, B_COEF, C_COEF, BF16)
        tl.debug_barrier()
        for h0 in range(0, HD, BH):
            block = _load(x_ptr + h0, rd, rh, D, HD - h0, HD, 1)
            _store(x_ptr + h0, _dot_add(A_COEF * block, poly, block, BF16), rd, rh, D, HD - h0, HD, 1)
        tl.debug_barrier()


@triton.jit(noinline=True)
def _ns_backward(s_ptr, dm_ptr, ds_ptr, sd, sh, iter_ptr, y_ptr, step_scale, D, HD, NS_STEPS: tl.constexpr,
                 A_COEF: tl.constexpr, B_COEF: tl.constexpr, C_COEF: tl.constexpr, BD: tl.constexpr,
                 BH: tl.constexpr, BF16: tl.constexpr):
    """Backward of M' = ... + step_scale NS(S') for one matrix, all three the (D, HD) view
    [d * sd + h * sh] of their buffers: S' at s_ptr, dL/dM' at dm_ptr; dL/dS' at ds_ptr is
    replaced in place by dL/dS' + step_scale NS'(S')^T dL/dM'. iter_ptr (NS_STEPS, D, HD) and
    y_ptr (D, HD) are scratch (row-major). With Y = dL/dX_{k+1}, A, B of step k:
    dB = Y X_k^T, dA = b dB + c (dB A + A dB), dX_k = a Y + B Y + (dA + dA^T) X_k.
    Not inlined, as `_ns_forward`: inlined, the compiler hoisted their address tiles out of
    the chunk loop and ptxas spilled them (bf16 products, the backward: 528 / 1,684 B spill
    stores / loads inlined, 572 / 916 B as functions of their own, the forward 4 B and none).
    ptxas then serializes the caller's wgmma around the calls."""
    rd, rh = tl.arange(0, BD), tl.arange(0, BH)
    squares = 0.0
    for h0 in range(0, HD, BH):
        block = _load(s_ptr + h0 * sh, rd, rh, D, HD - h0, sd, sh)
        squares += _inner(block, block)
    norm = tl.sqrt(squares)
    scale = 1.0 / (norm + 1e-7)
    for h0 in range(0, HD, BH):
        block = _load(s_ptr + h0 * sh, rd, rh, D, HD - h0, sd, sh)
        _store(iter_ptr + h0, block * scale, rd, rh, D, HD - h0, HD, 1)
        _store(y_ptr + h0, step_scale * _load(dm_ptr + h0 * sh, rd, rh, D, HD - h0, sd, sh), rd, rh, D, HD - h0, HD, 1)
    tl.debug_barrier()
    for k in tl.static_range(NS_STEPS - 1):  # the iterates X_1 .. X_{NS_STEPS - 1}
        here, there = iter_ptr + k * D * HD, iter_ptr + (k + 1) * D * HD
        gram = tl.zeros((BD, BD), dtype=tl.float32)
        for h0 in range(0, HD, BH):
            block = _load(here + h0, rd, rh, D, HD - h0, HD, 1)
            gram = _dot_add(gram, block, tl.trans(block), BF16)
        poly = _ns_poly(gram, B_COEF, C_COEF, BF16)
        for h0 in range(0, HD, BH):
            block = _load(here + h0, rd, rh, D, HD - h0, HD, 1)
            _store(there + h0, _dot_add(A_COEF * block, poly, block, BF16), rd, rh, D, HD - h0, HD, 1)
        tl.debug_barrier()
    for step in tl.static_range(NS_STEPS):
        here = iter_ptr + (NS_STEPS - 1 - step) * D * HD
        gram = tl.zeros((BD, BD), dtype=tl.float32)
        d_poly = tl.zeros((BD, BD), dtype=tl.float32)
        for h0 in range(0, HD, BH):
            block = _load(here + h0, rd, rh, D, HD - h0, HD, 1)
            grad = _load(y_ptr + h0, rd, rh, D, HD - h0, HD, 1)
            gram = _dot_add(gram, block, tl.trans(block), BF16)
            d_poly = _dot_add(d_poly, grad, tl.trans(block), BF16)
        poly = _ns_poly(gram, B_COEF, C_COEF, BF16)
        d_gram = C_COEF * _dot_add(_dot_add((B_COEF / C_COEF) * d_poly, d_poly, gram, BF16), gram, d_poly, BF16)
        d_gram = d_gram + tl.trans(d_gram)
        tl.debug_barrier()
        for h0 in range(0, HD, BH):
            block = _load(here + h0, rd, rh, D, HD - h0, HD, 1)
            grad = _load(y_ptr + h0, rd, rh, D, HD - h0, HD, 1)
            grad = _dot_add(_dot_add(A_COEF * grad, poly, grad, BF16), d_gram, block, BF16)
            _store(y_ptr + h0, grad, rd, rh, D, HD - h0, HD, 1)
        tl.debug_barrier()
    # X_0 = S' / (n + 1e-7), n = ||S'||_F
    inner = 0.0
    for h0 in range(0, HD, BH):
        block = _load(s_ptr + h0 * sh, rd, rh, D, HD - h0, sd, sh)
        inner += _inner(block, _load(y_ptr + h0, rd, rh, D, HD - h0, HD, 1))
    through_norm = tl.where(norm > 0, -inner * scale * scale / tl.maximum(norm, 1e-30), 0.0)
    for h0 in range(0, HD, BH):
        block = _load(s_ptr + h0 * sh, rd, rh, D, HD - h0, sd, sh)
        grad = _load(ds_ptr + h0 * sh, rd, rh, D, HD - h0, sd, sh)
        grad += _load(y_ptr + h0, rd, rh, D, HD - h0, HD, 1) * scale + through_norm * block
        _store(ds_ptr + h0 * sh, grad, rd, rh, D, HD - h0, sd, sh)
    tl.debug_barrier()


@triton.jit
def _state_block(old1, old2, h0, D, HD, rd, rh):
    """Hidden block h0 of the state [M; S] at old1 (W_1: 2 x (D, HD)) and old2 (W_2: 2 x (HD, D)):
    (M_1 (BD, BH), S_1, M_2 (BH, BD), S_2)."""
    w1 = _load(old1 + h0, rd, rh, D, HD - h0, HD, 1)
    s1 = _load(old1 + D * HD + h0, rd, rh, D, HD - h0, HD, 1)
    w2 = _load(old2 + h0 * D, rh, rd, HD - h0, D, D, 1)
    s2 = _load(old2 + HD * D + h0 * D, rh, rd, HD - h0, D, D, 1)
    return w1, s1, w2, s2


@triton.jit
def _mix_row(gates_ptr, row):
    """Row `row` of the mix rule's gates: m00, m01, m10, m11."""
    base = gates_ptr + row * 4
    return (tl.load(base).to(tl.float32), tl.load(base + 1).to(tl.float32), tl.load(base + 2).to(tl.float32),
            tl.load(base + 3).to(tl.float32))


@triton.jit
def _ns_row(gates_ptr, row):
    """Row `row` of the Newton-Schulz rule's gates: eta, alpha."""
    return tl.load(gates_ptr + row * 2).to(tl.float32), tl.load(gates_ptr + row * 2 + 1).to(tl.float32)


@triton.jit
def _key_error(k, v, w1_ptr, w2_ptr, D, HD, rd, rh, RESIDUAL: tl.constexpr, BH: tl.constexpr, BF16: tl.constexpr):
    """delta = M(k) - v (BC, BD), the error the write back-propagates."""
    out = _mlp(k, w1_ptr, w2_ptr, D, HD, rd, rh, BH, BF16)
    if RESIDUAL:
        out += k
    return out - v


@triton.jit
def _gradient_sums(k, delta, tw0, tw1, w1, w2, NS_STEPS: tl.constexpr, BF16: tl.constexpr):
    """Hidden block of the write's sums at the state W_1 block w1 (BD, BH), W_2 block w2 (BH, BD):
    (G_1[0] (BD, BH), G_1[1], G_2[0] (BH, BD), G_2[1]), G_1[m] = (k tw_m)^T err,
    G_2[m] = (act tw_m)^T delta, act = silu(k W_1), err = (delta W_2^T) silu'(k W_1); with
    NS_STEPS > 0 one weighting, returned as both m."""
    act, d1, d2 = _silu_parts(_dot(k, w1, BF16))
    err = _dot(delta, tl.trans(w2), BF16) * d1  # the error back through W_2 and the SiLU, (BC, BH)
    g1_0 = _dot(tl.trans(k * tw0[:, None]), err, BF16)
    g2_0 = _dot(tl.trans(act * tw0[:, None]), delta, BF16)
    g1_1 = g1_0
    g2_1 = g2_0
    if NS_STEPS == 0:
        g1_1 = _dot(tl.trans(k * tw1[:, None]), err, BF16)
        g2_1 = _dot(tl.trans(act * tw1[:, None]), delta, BF16)
    return g1_0, g1_1, g2_0, g2_1


@triton.jit
def _put_block(new1, new2, h0, m1, s1, m2, s2, D, HD, rd, rh, NS_STEPS: tl.constexpr):
    """Stores hidden block h0 of [M; S] of W_1 (m1, s1 (BD, BH)) and W_2 (m2, s2 (BH, BD)) at
    new1 / new2; with NS_STEPS > 0 only S (M follows Newton-Schulz)."""
    if NS_STEPS == 0:
        _store(new1 + h0, m1, rd, rh, D, HD - h0, HD, 1)
        _store(new2 + h0 * D, m2, rh, rd, HD - h0, D, D, 1)
    _store(new1 + D * HD + h0, s1, rd, rh, D, HD - h0, HD, 1)
    _store(new2 + HD * D + h0 * D, s2, rh, rd, HD - h0, D, D, 1)


@triton.jit
def _rule_block(gates_ptr, row, w, s, g0, g1, NS_STEPS: tl.constexpr):
    """One matrix's block of the rule before Newton-Schulz, (M', S'): the mix rule
    [M'; S'] = mix [M; S] + [G_0; G_1]; Newton-Schulz S' = eta S - G_0 (M' returned as M)."""
    if NS_STEPS > 0:
        eta, alpha = _ns_row(gates_ptr, row)
        new_m = w
        new_s = eta * s - g0
    else:
        m00, m01, m10, m11 = _mix_row(gates_ptr, row)
        new_m = m00 * w + m01 * s + g0
        new_s = m10 * w + m11 * s + g1
    return new_m, new_s


@triton.jit
def _clip_scale(square_sum, limit):
    """The bound's s = limit / max(||G||_F, limit), ||G||_F^2 = square_sum."""
    return limit / tl.maximum(tl.sqrt(square_sum), limit)


@triton.jit
def _inner(x, y):
    """sum(x * y) of two tiles, a scalar."""
    return tl.sum(tl.sum(x * y, axis=1), axis=0)


@triton.jit
def _write_chunk(q_ptr, k_ptr, v_ptr, tw_ptr, gates_ptr, limit_ptr, scale_ptr, row, old1, old2, new1, new2, x1, x2,
                 step_scale, C, D, HD, rc, rd, rh, K: tl.constexpr, NS_STEPS: tl.constexpr, A_COEF: tl.constexpr,
                 B_COEF: tl.constexpr, C_COEF: tl.constexpr, RESIDUAL: tl.constexpr, READ_AFTER_WRITE: tl.constexpr,
                 READ: tl.constexpr, LIMITED: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BF16: tl.constexpr):
    """One chunk, `row` = (batch, head) * N + chunk of the inputs (q, k, v (rows, C, D), token
    weights (rows, C, K), gates (rows, 4): the mix [[m00, m01], [m10, m11]], or (rows, 2) =
    (eta, alpha) with NS_STEPS > 0): the state at old1 / old2 ([M; S] of W_1 (2, D, HD) and W_2
    (2, HD, D)) written to new1 / new2. x1, x2 (D, HD) scratch for Newton-Schulz. Returns the
    chunk's reads y (BC, BD) when READ. LIMITED: each G_m of each matrix times
    s = limit_m / max(||G_m||_F, limit_m) (limits (rows, K); the norm over every hidden block,
    so G is stored first, in the new state's slots, then combined), the scales written to
    scales (rows, 2, 2) = [matrix][m] (m = 1 repeating m = 0 with one weighting)."""
    q_rows = q_ptr + row * C * D
    k = _load(k_ptr + row * C * D, rc, rd, C, D, D, 1)
    v = _load(v_ptr + row * C * D, rc, rd, C, D, D, 1)
    tw0 = _token_weight(tw_ptr, row, C, K, 0, rc)
    tw1 = _token_weight(tw_ptr, row, C, K, K - 1, rc)
    delta = _key_error(k, v, old1, old2, D, HD, rd, rh, RESIDUAL, BH, BF16)
    y = tl.zeros_like(k)
    if READ and not READ_AFTER_WRITE:
        y = _mlp(_load(q_rows, rc, rd, C, D, D, 1), old1, old2, D, HD, rd, rh, BH, BF16)
    if LIMITED:
        squares1_0 = 0.0
        squares1_1 = 0.0
        squares2_0 = 0.0
        squares2_1 = 0.0
        for h0 in range(0, HD, BH):
            w1 = _load(old1 + h0, rd, rh, D, HD - h0, HD, 1)
            w2 = _load(old2 + h0 * D, rh, rd, HD - h0, D, D, 1)
            g1_0, g1_1, g2_0, g2_1 = _gradient_sums(k, delta, tw0, tw1, w1, w2, NS_STEPS, BF16)
            _put_block(new1, new2, h0, g1_0, g1_1, g2_0, g2_1, D, HD, rd, rh, NS_STEPS)
            squares1_0 += _inner(g1_0, g1_0)
            squares1_1 += _inner(g1_1, g1_1)
            squares2_0 += _inner(g2_0, g2_0)
            squares2_1 += _inner(g2_1, g2_1)
        limit0 = tl.load(limit_ptr + row * K).to(tl.float32)
        limit1 = tl.load(limit_ptr + row * K + K - 1).to(tl.float32)
        scale1_0 = _clip_scale(squares1_0, limit0)
        scale1_1 = _clip_scale(squares1_1, limit1)
        scale2_0 = _clip_scale(squares2_0, limit0)
        scale2_1 = _clip_scale(squares2_1, limit1)
        tl.store(scale_ptr + row * 4, scale1_0)
        tl.store(scale_ptr + row * 4 + 1, scale1_1)
        tl.store(scale_ptr + row * 4 + 2, scale2_0)
        tl.store(scale_ptr + row * 4 + 3, scale2_1)
        tl.debug_barrier()
        for h0 in range(0, HD, BH):  # each element rewritten by the thread that stored its G above
            w1, s1, w2, s2 = _state_block(old1, old2, h0, D, HD, rd, rh)
            g1_0, g1_1, g2_0, g2_1 = _state_block(new1, new2, h0, D, HD, rd, rh)
            if NS_STEPS > 0:  # G_0 is in the S slots
                g1_0 = g1_1
                g2_0 = g2_1
            m1, s1 = _rule_block(gates_ptr, row, w1, s1, scale1_0 * g1_0, scale1_1 * g1_1, NS_STEPS)
            m2, s2 = _rule_block(gates_ptr, row, w2, s2, scale2_0 * g2_0, scale2_1 * g2_1, NS_STEPS)
            _put_block(new1, new2, h0, m1, s1, m2, s2, D, HD, rd, rh, NS_STEPS)
    else:
        for h0 in range(0, HD, BH):
            w1, s1, w2, s2 = _state_block(old1, old2, h0, D, HD, rd, rh)
            g1_0, g1_1, g2_0, g2_1 = _gradient_sums(k, delta, tw0, tw1, w1, w2, NS_STEPS, BF16)
            m1, s1 = _rule_block(gates_ptr, row, w1, s1, g1_0, g1_1, NS_STEPS)
            m2, s2 = _rule_block(gates_ptr, row, w2, s2, g2_0, g2_1, NS_STEPS)
            _put_block(new1, new2, h0, m1, s1, m2, s2, D, HD, rd, rh, NS_STEPS)
    tl.debug_barrier()
    size1 = D * HD
    if NS_STEPS > 0:  # M' = (1 - alpha) M + step_scale NS(S'), per matrix on its (D, HD) view
        eta, alpha = _ns_row(gates_ptr, row)
        _ns_forward(new1 + size1, HD, 1, x1, D, HD, NS_STEPS, A_COEF, B_COEF, C_COEF, BD, BH, BF16)
        _ns_forward(new2 + size1, 1, D, x2, D, HD, NS_STEPS, A_COEF, B_COEF, C_COEF, BD, BH, BF16)
        for h0 in range(0, HD, BH):
            w1 = _load(old1 + h0, rd, rh, D, HD - h0, HD, 1)
            w2t = _load(old2 + h0 * D, rd, rh, D, HD - h0, 1, D)
            step1 = _load(x1 + h0, rd, rh, D, HD - h0, HD, 1)
            step2 = _load(x2 + h0, rd, rh, D, HD - h0, HD, 1)
            _store(new1 + h0, (1 - alpha) * w1 + step_scale * step1, rd, rh, D, HD - h0, HD, 1)
            _store(new2 + h0 * D, (1 - alpha) * w2t + step_scale * step2, rd, rh, D, HD - h0, 1, D)
        tl.debug_barrier()
    if READ and READ_AFTER_WRITE:
        y = _mlp(_load(q_rows, rc, rd, C, D, D, 1), new1, new2, D, HD, rd, rh, BH, BF16)
    if READ and RESIDUAL:
        y += _load(q_rows, rc, rd, C, D, D, 1)
    return y


@triton.jit
def _state_pointers(ck1_ptr, ck2_ptr, seg1_ptr, seg2_ptr, init1_ptr, init2_ptr, fin1_ptr, fin2_ptr, pid, c, first, last,
                    G, NG, N, D, HD):
    """(old1, old2, new1, new2) of chunk c in the group of chunks first .. last (g = first // G):
    the group's entering state is checkpoint g, its result checkpoint g + 1; the states between
    are entries c - first of the group's buffer seg (G, 2, ...). Chunk 0 reads the initial state
    at init, chunk N - 1 writes the final state to fin (checkpoints 0 and NG are not used)."""
    size1 = D * HD
    g = first // G
    old1 = seg1_ptr + (pid * G + c - first) * 2 * size1
    old2 = seg2_ptr + (pid * G + c - first) * 2 * size1
    if c == first:
        old1 = ck1_ptr + (pid * (NG + 1) + g) * 2 * size1
        old2 = ck2_ptr + (pid * (NG + 1) + g) * 2 * size1
        if c == 0:
            old1 = init1_ptr + pid * 2 * size1
            old2 = init2_ptr + pid * 2 * size1
    new1 = seg1_ptr + (pid * G + c + 1 - first) * 2 * size1
    new2 = seg2_ptr + (pid * G + c + 1 - first) * 2 * size1
    if c == last:
        new1 = ck1_ptr + (pid * (NG + 1) + g + 1) * 2 * size1
        new2 = ck2_ptr + (pid * (NG + 1) + g + 1) * 2 * size1
        if c == N - 1:
            new1 = fin1_ptr + pid * 2 * size1
            new2 = fin2_ptr + pid * 2 * size1
    return old1, old2, new1, new2


@triton.jit
def _copy_state(source, target, size, BLOCK: tl.constexpr):
    """target[0:size] = source[0:size] (one program's state block, fp32)."""
    for start in range(0, size, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        tl.store(target + offsets, tl.load(source + offsets, mask=offsets < size), mask=offsets < size)


@triton.jit
def _sum_gradients(dn1_0, dn1_1, dn2_0, dn2_1, scale1_0, scale1_1, scale2_0, scale2_1, NS_STEPS: tl.constexpr):
    """(gG_1[0], gG_1[1], gG_2[0], gG_2[1]) = dL/dG_m of each matrix's block from the state's
    gradient blocks dL/d[M'; S'] (dn*_0, dn*_1): the mix rule adds G_m to row m; Newton-Schulz
    S' = eta S - G_0 (m = 1 repeats m = 0). Times the bound's scales (constants in backward)."""
    if NS_STEPS > 0:
        gg1_0 = -scale1_0 * dn1_1
        gg1_1 = gg1_0
        gg2_0 = -scale2_0 * dn2_1
        gg2_1 = gg2_0
    else:
        gg1_0 = scale1_0 * dn1_0
        gg1_1 = scale1_1 * dn1_1
        gg2_0 = scale2_0 * dn2_0
        gg2_1 = scale2_1 * dn2_1
    return gg1_0, gg1_1, gg2_0, gg2_1


@triton.jit
def whole_sequence_fwd(q_ptr, k_ptr, v_ptr, tw_ptr, gates_ptr, limit_ptr, scale_ptr, ck1_ptr, ck2_ptr, seg1_ptr,
                       seg2_ptr, init1_ptr, init2_ptr, fin1_ptr, fin2_ptr, y_ptr, x_ptr, step_scale, N, G, C, D, HD,
                       K: tl.constexpr, NS_STEPS: tl.constexpr,
                       A_COEF: tl.constexpr, B_COEF: tl.constexpr, C_COEF: tl.constexpr, RESIDUAL: tl.constexpr,
                       READ_AFTER_WRITE: tl.constexpr, LIMITED: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
                       BH: tl.constexpr, BF16: tl.constexpr):
    """One (batch, head) over its N chunks in groups of G. q, k, v (N, C, D); tw (N, C, K);
    gates (N, 4) = the mix [[m00, m01], [m10, m11]] (NS_STEPS 0) or (N, 2) = (eta, alpha);
    with LIMITED the surprise bound's limits (N, K), its scales written to scale (N, 2, 2);
    ck1 (NG + 1, 2, D, HD), ck2 (NG + 1, 2, HD, D), NG = ceil(N / G), with ck[0] given: writes
    ck[g] = the state entering chunk g G, ck[NG] = the final state, and y (N, C, D); seg1, seg2
    (G, 2, ...) hold the states inside a group; x (2, D, HD) scratch."""
    pid = tl.program_id(0).to(tl.int64)
    rc, rd, rh = tl.arange(0, BC), tl.arange(0, BD), tl.arange(0, BH)
    NG = (N + G - 1) // G
    x1 = x_ptr + pid * 2 * D * HD
    for c in range(N):
        first = (c // G) * G
        last = tl.minimum(first + G, N) - 1
        old1, old2, new1, new2 = _state_pointers(ck1_ptr, ck2_ptr, seg1_ptr, seg2_ptr, init1_ptr, init2_ptr, fin1_ptr,
                                                 fin2_ptr, pid, c, first, last, G, NG, N, D, HD)
        y = _write_chunk(q_ptr, k_ptr, v_ptr, tw_ptr, gates_ptr, limit_ptr, scale_ptr, pid * N + c, old1, old2, new1,
                         new2, x1, x1 + D * HD, step_scale, C, D, HD, rc, rd, rh, K, NS_STEPS, A_COEF, B_COEF, C_COEF,
                         RESIDUAL, READ_AFTER_WRITE, True, LIMITED, BD, BH, BF16)
        _store(y_ptr + (pid * N + c) * C * D, y, rc, rd, C, D, D, 1)
        tl.debug_barrier()


@triton.jit
def whole_sequence_bwd(q_ptr, k_ptr, v_ptr, tw_ptr, gates_ptr, limit_ptr, scale_ptr, rescale_ptr, ck1_ptr, ck2_ptr,
                       seg1_ptr, seg2_ptr, init1_ptr, init2_ptr, fin1_ptr, fin2_ptr, dy_ptr, dn1_ptr, dn2_ptr, ds1_ptr,
                       ds2_ptr, dq_ptr, dk_ptr, dv_ptr, dtw_ptr, dgates_ptr, iter_ptr,
                       ybuf_ptr, step_scale, N, G, C, D, HD, K: tl.constexpr, NS_STEPS: tl.constexpr,
                       A_COEF: tl.constexpr, B_COEF: tl.constexpr, C_COEF: tl.constexpr, RESIDUAL: tl.constexpr,
                       READ_AFTER_WRITE: tl.constexpr, LIMITED: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
                       BH: tl.constexpr, BF16: tl.constexpr):
    """One (batch, head), groups of G chunks from the last: each group's states are recomputed
    from its checkpoint into seg (as the forward), then its chunks N-1 .. 0 run backward. ds1 (2, D, HD),
    ds2 (2, HD, D) start as dL/d(final state) (copied from dn1, dn2) and leave as dL/d(initial state); the
    initial and final states at init and fin (the forward's `_state_pointers`); the recomputation's
    scales go to rescale (the forward's at scale are read); writes dq, dk, dv
    (N, C, D), dtw (N, C, K), dgates like gates. Scratch: iter (2, NS_STEPS, D, HD), ybuf (2, D, HD).
    LIMITED: the bound's scales (N, 2, 2) of the forward are constants here (G_m enters as s G_m).

    Per chunk, with gG_m = dL/dG_m (the mix rule: dL/d[M'; S']; Newton-Schulz: G_0 enters
    S' = eta S - G_0, so gG_0 = -dL/dS' after NS's backward): G_2[m] = (act tw_m)^T delta,
    G_1[m] = (k tw_m)^T err, err = (delta W_2^T) silu'(pre), delta = M(k) - v. Pass 1 sums
    dL/d delta over the hidden blocks, pass 2 writes the weights' gradients, then (the read of
    the state before the write) the read's backward adds its own."""
    pid = tl.program_id(0).to(tl.int64)
    rc, rd, rh = tl.arange(0, BC), tl.arange(0, BD), tl.arange(0, BH)
    size1, size2 = D * HD, HD * D
    ds1, ds2 = ds1_ptr + pid * 2 * size1, ds2_ptr + pid * 2 * size2
    NG = (N + G - 1) // G
    x1 = ybuf_ptr + pid * 2 * size1  # Newton-Schulz scratch of the recomputation (free until the backward)
    _copy_state(dn1_ptr + pid * 2 * size1, ds1, 2 * size1, BD * BH)
    _copy_state(dn2_ptr + pid * 2 * size2, ds2, 2 * size2, BD * BH)
    tl.debug_barrier()
    for step in range(N):
        c = N - 1 - step
        row = pid * N + c
        first = (c // G) * G
        last = tl.minimum(first + G, N) - 1
        if c == last:  # entering a group from its end: recompute the states between its checkpoints
            for r in range(first, last):
                r_old1, r_old2, r_new1, r_new2 = _state_pointers(ck1_ptr, ck2_ptr, seg1_ptr, seg2_ptr, init1_ptr,
                                                                 init2_ptr, fin1_ptr, fin2_ptr, pid, r, first, last,
                                                                 G, NG, N, D, HD)
                _write_chunk(q_ptr, k_ptr, v_ptr, tw_ptr, gates_ptr, limit_ptr, rescale_ptr, pid * N + r, r_old1, r_old2,
                             r_new1, r_new2, x1, x1 + size1, step_scale, C, D, HD, rc, rd, rh, K, NS_STEPS, A_COEF,
                             B_COEF, C_COEF, RESIDUAL, READ_AFTER_WRITE, False, LIMITED, BD, BH, BF16)
                tl.debug_barrier()
        old1, old2, new1, new2 = _state_pointers(ck1_ptr, ck2_ptr, seg1_ptr, seg2_ptr, init1_ptr, init2_ptr, fin1_ptr,
                                                 fin2_ptr, pid, c, first, last, G, NG, N, D, HD)
        if READ_AFTER_WRITE:  # y = M'(q): into dL/dM' before anything reads it
            _read_backward(q_ptr, dy_ptr, dq_ptr, row, new1, new2, ds1, ds2, C, D, HD, rc, rd, rh, RESIDUAL, BH, BF16)
            tl.debug_barrier()
        scale1_0 = 1.0
        scale1_1 = 1.0
        scale2_0 = 1.0
        scale2_1 = 1.0
        if LIMITED:
            scale1_0 = tl.load(scale_ptr + row * 4)
            scale1_1 = tl.load(scale_ptr + row * 4 + 1)
            scale2_0 = tl.load(scale_ptr + row * 4 + 2)
            scale2_1 = tl.load(scale_ptr + row * 4 + 3)
        if NS_STEPS > 0:
            eta, alpha = _ns_row(gates_ptr, row)
            d_eta = 0.0
            d_alpha = 0.0
            _ns_backward(new1 + size1, ds1, ds1 + size1, HD, 1, iter_ptr + pid * 2 * NS_STEPS * size1,
                         ybuf_ptr + pid * 2 * size1, step_scale, D, HD, NS_STEPS, A_COEF, B_COEF, C_COEF, BD, BH, BF16)
            _ns_backward(new2 + size2, ds2, ds2 + size2, 1, D, iter_ptr + (pid * 2 + 1) * NS_STEPS * size1,
                         ybuf_ptr + (pid * 2 + 1) * size1, step_scale, D, HD, NS_STEPS, A_COEF, B_COEF, C_COEF,
                         BD, BH, BF16)
        else:
            m00, m01, m10, m11 = _mix_row(gates_ptr, row)
            d00 = 0.0
            d01 = 0.0
            d10 = 0.0
            d11 = 0.0
        k = _load(k_ptr + row * C * D, rc, rd, C, D, D, 1)
        tw0 = _token_weight(tw_ptr, row, C, K, 0, rc)
        tw1 = _token_weight(tw_ptr, row, C, K, K - 1, rc)
        delta = _key_error(k, _load(v_ptr + row * C * D, rc, rd, C, D, D, 1), old1, old2, D, HD, rd, rh, RESIDUAL,
                           BH, BF16)
        # pass 1: dL/d delta, a sum over the hidden blocks that pass 2 needs whole; the gates' gradients
        d_delta = tl.zeros_like(delta)
        for h0 in range(0, HD, BH):
            w1, s1, w2, s2 = _state_block(old1, old2, h0, D, HD, rd, rh)
            act, d1, d2 = _silu_parts(_dot(k, w1, BF16))
            dn1_0, dn1_1, dn2_0, dn2_1 = _state_block(ds1, ds2, h0, D, HD, rd, rh)
            if NS_STEPS > 0:  # M' = (1 - alpha) M + step_scale NS(S'), S' = eta S - G_0
                d_alpha -= _inner(dn1_0, w1) + _inner(dn2_0, w2)
                d_eta += _inner(dn1_1, s1) + _inner(dn2_1, s2)
            else:  # [M'; S'] = mix [M; S] + [G_0; G_1]
                d00 += _inner(dn1_0, w1) + _inner(dn2_0, w2)
                d01 += _inner(dn1_0, s1) + _inner(dn2_0, s2)
                d10 += _inner(dn1_1, w1) + _inner(dn2_1, w2)
                d11 += _inner(dn1_1, s1) + _inner(dn2_1, s2)
            gg1_0, gg1_1, gg2_0, gg2_1 = _sum_gradients(dn1_0, dn1_1, dn2_0, dn2_1, scale1_0, scale1_1, scale2_0,
                                                        scale2_1, NS_STEPS)
            d_err = tw0[:, None] * _dot(k, gg1_0, BF16)  # dL/d err, (BC, BH)
            d_delta = _dot_add(d_delta, act * tw0[:, None], gg2_0, BF16)
            if K == 2:
                d_err += tw1[:, None] * _dot(k, gg1_1, BF16)
                d_delta = _dot_add(d_delta, act * tw1[:, None], gg2_1, BF16)
            d_delta = _dot_add(d_delta, d_err * d1, w2, BF16)
        tl.debug_barrier()  # pass 2 overwrites the gradient blocks pass 1 read
        # pass 2: the weights' gradients, written with the state's into the gradient buffers; k's
        # and the token weights' gradients
        dk = d_delta if RESIDUAL else tl.zeros_like(k)
        dtw0 = tl.zeros_like(tw0)
        dtw1 = tl.zeros_like(tw1)
        for h0 in range(0, HD, BH):
            w1 = _load(old1 + h0, rd, rh, D, HD - h0, HD, 1)
            w2 = _load(old2 + h0 * D, rh, rd, HD - h0, D, D, 1)
            act, d1, d2 = _silu_parts(_dot(k, w1, BF16))
            err_in = _dot(delta, tl.trans(w2), BF16)
            err = err_in * d1
            dn1_0, dn1_1, dn2_0, dn2_1 = _state_block(ds1, ds2, h0, D, HD, rd, rh)
            gg1_0, gg1_1, gg2_0, gg2_1 = _sum_gradients(dn1_0, dn1_1, dn2_0, dn2_1, scale1_0, scale1_1, scale2_0,
                                                        scale2_1, NS_STEPS)
            through1 = _dot(k, gg1_0, BF16)  # (BC, BH)
            through2 = _dot(delta, tl.trans(gg2_0), BF16)  # (BC, BH)
            dtw0 += tl.sum(through2 * act + through1 * err, axis=1)
            d_err = tw0[:, None] * through1
            d_act = tw0[:, None] * through2
            dk = _dot_add(dk, err * tw0[:, None], tl.trans(gg1_0), BF16)
            if K == 2:
                through1 = _dot(k, gg1_1, BF16)
                through2 = _dot(delta, tl.trans(gg2_1), BF16)
                dtw1 += tl.sum(through2 * act + through1 * err, axis=1)
                d_err += tw1[:, None] * through1
                d_act += tw1[:, None] * through2
                dk = _dot_add(dk, err * tw1[:, None], tl.trans(gg1_1), BF16)
            d_err_in = d_err * d1
            d_act = _dot_add(d_act, d_delta, tl.trans(w2), BF16)
            d_pre = d_act * d1 + d_err * err_in * d2
            dk = _dot_add(dk, d_pre, tl.trans(w1), BF16)
            dw1 = _dot(tl.trans(k), d_pre, BF16)
            dw2 = _dot_add(_dot(tl.trans(d_err_in), delta, BF16), tl.trans(act), d_delta, BF16)
            if NS_STEPS > 0:
                _store(ds1 + h0, (1 - alpha) * dn1_0 + dw1, rd, rh, D, HD - h0, HD, 1)
                _store(ds1 + size1 + h0, eta * dn1_1, rd, rh, D, HD - h0, HD, 1)
                _store(ds2 + h0 * D, (1 - alpha) * dn2_0 + dw2, rh, rd, HD - h0, D, D, 1)
                _store(ds2 + size2 + h0 * D, eta * dn2_1, rh, rd, HD - h0, D, D, 1)
            else:
                _store(ds1 + h0, m00 * dn1_0 + m10 * dn1_1 + dw1, rd, rh, D, HD - h0, HD, 1)
                _store(ds1 + size1 + h0, m01 * dn1_0 + m11 * dn1_1, rd, rh, D, HD - h0, HD, 1)
                _store(ds2 + h0 * D, m00 * dn2_0 + m10 * dn2_1 + dw2, rh, rd, HD - h0, D, D, 1)
                _store(ds2 + size2 + h0 * D, m01 * dn2_0 + m11 * dn2_1, rh, rd, HD - h0, D, D, 1)
        if not READ_AFTER_WRITE:  # y = M(q) read the state before the write: its gradient joins dL/dM
            tl.debug_barrier()
            _read_backward(q_ptr, dy_ptr, dq_ptr, row, old1, old2, ds1, ds2, C, D, HD, rc, rd, rh, RESIDUAL, BH, BF16)
        rows = row * C * D
        _store(dk_ptr + rows, dk, rc, rd, C, D, D, 1)
        _store(dv_ptr + rows, -d_delta, rc, rd, C, D, D, 1)
        tw_rows = dtw_ptr + row * C * K + rc * K
        tl.store(tw_rows, dtw0, mask=rc < C)
        if K == 2:
            tl.store(tw_rows + 1, dtw1, mask=rc < C)
        if NS_STEPS > 0:
            tl.store(dgates_ptr + row * 2, d_eta)
            tl.store(dgates_ptr + row * 2 + 1, d_alpha)
        else:
            tl.store(dgates_ptr + row * 4, d00)
            tl.store(dgates_ptr + row * 4 + 1, d01)
            tl.store(dgates_ptr + row * 4 + 2, d10)
            tl.store(dgates_ptr + row * 4 + 3, d11)
        tl.debug_barrier()
