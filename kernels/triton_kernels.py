"""Triton kernels for Newton-Schulz orthogonalisation and the fused memory-update step.

Matrices are read oriented so that rows <= cols, tall ones through swapped strides (no
transpose copies). Two Newton-Schulz paths (`kernels/reference.py` states the iteration):

- Per matrix (`newton_schulz_triton`, and the fused update): one program per matrix (rows
  <= 128, cols <= 512, the sizes of the memories' fast weights) runs the Frobenius
  normalisation and all `steps` quintic iterations in one launch, on an fp32 copy of its
  matrix in a workspace (L2-resident at these sizes). Per step the Gram product X X^T
  accumulates over column blocks, then each column block becomes a X_k + P X_k. Only
  (rows, rows) tiles and one column block are live at once: holding the whole 64 x 256
  fp32 matrix as one tile needed 262,168 bytes of shared memory on an H100 (limit
  232,448). For small matrices the launches and round trips of a per-step path cost more
  than the arithmetic, so one launch for the whole iteration wins. The fused update
  (`kernels/reference.py` states it) also reads the weight, momentum and gradient and
  writes the new weight and momentum in the same program.
- Blocked (`newton_schulz_blocked`, any size): per step two Gram products by
  `_symmetric_gram_kernel`, A = X X^T and B = b A + c A A^T (A is symmetric, so A^2 = A A^T
  is a Gram product too), and X = a X + B X by torch. A Gram product is symmetric, so the
  kernel computes only the upper-triangular blocks (one program per block pair i <= j,
  n (n + 1) / 2 of the n^2), looping over the columns, and writes each block to (i, j) and
  mirrored to (j, i): about half the multiply-adds, and an exactly symmetric result.

Inputs fp32 or bf16, accumulation in fp32 (fp32 inputs' dots in 3xTF32, about fp32
accuracy on tensor cores; the per-matrix kernels use TF32 for bf16 inputs).

Backward: recompute. It re-runs the torch reference under autograd and differentiates
it, storing nothing but the inputs (saving the `steps` iterates instead would keep
`steps` extra copies of every momentum matrix, for a backward that is small next to the
memory's forward and backward).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.auto_table import MAX_COLS, MAX_ROWS  # the per-matrix path's largest matrix
from kernels.reference import MUON_COEFFICIENTS, coefficient_schedule, memory_update_reference, newton_schulz_reference

# fp32 dots: three TF32 tensor-core products (about fp32 accuracy). "ieee" lowers a tile dot
# to unrolled scalar FMAs: measured on an H100 (Triton 3.6), compiling the one-tile Newton-Schulz kernel
# for a 64 x 256 matrix had not finished after 80 s.
FP32_DOT_PRECISION = "tf32x3"
FP32_DOT = tl.constexpr(FP32_DOT_PRECISION)  # the same, for use inside kernels


@triton.jit
def _column_block(matrix, k0, rows, cols, stride_b, stride_r, stride_c, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Element offsets of columns k0 .. k0 + BLOCK_K of this program's matrix, read as (rows,
    cols) through the strides, their in-bounds mask, and their offsets in the contiguous fp32
    workspace (batch, rows, cols)."""
    r = tl.arange(0, BLOCK_R)[:, None]
    k = k0 + tl.arange(0, BLOCK_K)[None, :]
    inside = (r < rows) & (k < cols)
    return matrix * stride_b + r * stride_r + k * stride_c, inside, matrix * rows * cols + r * cols + k


@triton.jit
def _orthogonalise(work_ptr, matrix, rows, cols, coef_ptr, STEPS: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Newton-Schulz in place on this program's matrix X (rows <= cols) of the contiguous fp32
    workspace; coef_ptr: (STEPS, 3). The matrix is streamed in column blocks: per step the
    Gram product G = X X^T accumulates over the blocks, P = b G + c G G, then each block is
    replaced by a X_k + P X_k (it depends on its own columns only, so in place is exact).
    Only (rows, rows) tiles and one column block are live at a time, which keeps a 128 x 512
    matrix within a Hopper SM's shared memory (the whole tile needs more than its 227 KiB)."""
    sum_sq = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, cols, BLOCK_K):
        _, inside, work = _column_block(matrix, k0, rows, cols, 0, 0, 0, BLOCK_R, BLOCK_K)
        x = tl.load(work_ptr + work, mask=inside, other=0.0)
        sum_sq += x * x
    scale = 1.0 / (tl.sqrt(tl.sum(tl.sum(sum_sq, axis=1), axis=0)) + 1e-7)
    for k0 in range(0, cols, BLOCK_K):  # each element is read and written by the same thread
        _, inside, work = _column_block(matrix, k0, rows, cols, 0, 0, 0, BLOCK_R, BLOCK_K)
        tl.store(work_ptr + work, scale * tl.load(work_ptr + work, mask=inside, other=0.0), mask=inside)
    tl.debug_barrier()
    for i in range(STEPS):  # a loop, not unrolled: unrolled tile dots stall LLVM for minutes
        a = tl.load(coef_ptr + 3 * i)
        b = tl.load(coef_ptr + 3 * i + 1)
        c = tl.load(coef_ptr + 3 * i + 2)
        gram = tl.zeros((BLOCK_R, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, cols, BLOCK_K):
            _, inside, work = _column_block(matrix, k0, rows, cols, 0, 0, 0, BLOCK_R, BLOCK_K)
            x = tl.load(work_ptr + work, mask=inside, other=0.0)
            gram = tl.dot(x, tl.trans(x), gram, input_precision=PRECISION)
        poly = b * gram + c * tl.dot(gram, gram, input_precision=PRECISION)
        tl.debug_barrier()  # every thread's reads of X precede the first block written below
        for k0 in range(0, cols, BLOCK_K):
            _, inside, work = _column_block(matrix, k0, rows, cols, 0, 0, 0, BLOCK_R, BLOCK_K)
            x = tl.load(work_ptr + work, mask=inside, other=0.0)
            tl.store(work_ptr + work, a * x + tl.dot(poly, x, input_precision=PRECISION), mask=inside)
        tl.debug_barrier()  # the new X is written before the next step reads it


@triton.jit
def _newton_schulz_kernel(x_ptr, work_ptr, out_ptr, rows, cols, stride_b, stride_r, stride_c, coef_ptr,
                          STEPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    matrix = tl.program_id(0).to(tl.int64)
    for k0 in range(0, cols, BLOCK_K):
        offsets, inside, work = _column_block(matrix, k0, rows, cols, stride_b, stride_r, stride_c, BLOCK_R, BLOCK_K)
        tl.store(work_ptr + work, tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32), mask=inside)
    tl.debug_barrier()
    _orthogonalise(work_ptr, matrix, rows, cols, coef_ptr, STEPS, BLOCK_R, BLOCK_K, PRECISION)
    for k0 in range(0, cols, BLOCK_K):
        offsets, inside, work = _column_block(matrix, k0, rows, cols, stride_b, stride_r, stride_c, BLOCK_R, BLOCK_K)
        x = tl.load(work_ptr + work, mask=inside, other=0.0)
        tl.store(out_ptr + offsets, x.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _memory_update_kernel(w_ptr, s_ptr, g_ptr, eta_ptr, alpha_ptr, work_ptr, w_out_ptr, s_out_ptr, rows, cols,
                          stride_b, stride_r, stride_c, coef_ptr, step_scale,
                          STEPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    matrix = tl.program_id(0).to(tl.int64)
    eta = tl.load(eta_ptr + matrix).to(tl.float32)
    retain = 1.0 - tl.load(alpha_ptr + matrix).to(tl.float32)
    for k0 in range(0, cols, BLOCK_K):
        offsets, inside, work = _column_block(matrix, k0, rows, cols, stride_b, stride_r, stride_c, BLOCK_R, BLOCK_K)
        s = eta * tl.load(s_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        s = s - tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        tl.store(s_out_ptr + offsets, s.to(s_out_ptr.dtype.element_ty), mask=inside)
        tl.store(work_ptr + work, s, mask=inside)
    if STEPS > 0:
        tl.debug_barrier()
        _orthogonalise(work_ptr, matrix, rows, cols, coef_ptr, STEPS, BLOCK_R, BLOCK_K, PRECISION)
    for k0 in range(0, cols, BLOCK_K):
        offsets, inside, work = _column_block(matrix, k0, rows, cols, stride_b, stride_r, stride_c, BLOCK_R, BLOCK_K)
        w = retain * tl.load(w_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        w += step_scale * tl.load(work_ptr + work, mask=inside, other=0.0)
        tl.store(w_out_ptr + offsets, w.to(w_out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _symmetric_gram_kernel(x_ptr, cin_ptr, out_ptr, pairs_ptr, n_pairs, rows, cols, stride_b, stride_r, stride_c,
                           alpha, beta, HAS_CIN: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """OUT = beta Cin + alpha X X^T on block pair `pairs[:, program_id(1)]` = (i, j), i <= j, of
    matrix program_id(0), written to block (i, j) and mirrored to (j, i). x (batch, rows, cols)
    through its strides; cin (read only if HAS_CIN, symmetric: only its upper triangle is read)
    and out contiguous (batch, rows, rows); pairs (2, n_pairs) int32."""
    matrix = tl.program_id(0).to(tl.int64)  # no size limit on this path: batch offsets in int64
    pair = tl.program_id(1)
    ri = tl.load(pairs_ptr + pair) * BLOCK + tl.arange(0, BLOCK)
    rj = tl.load(pairs_ptr + n_pairs + pair) * BLOCK + tl.arange(0, BLOCK)
    xi_ptr = x_ptr + matrix * stride_b + ri[:, None] * stride_r
    xj_ptr = x_ptr + matrix * stride_b + rj[:, None] * stride_r
    in_i, in_j = ri[:, None] < rows, rj[:, None] < rows
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, cols, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        xi = tl.load(xi_ptr + k * stride_c, mask=in_i & (k < cols), other=0.0).to(tl.float32)
        xj = tl.load(xj_ptr + k * stride_c, mask=in_j & (k < cols), other=0.0).to(tl.float32)
        acc = tl.dot(xi, tl.trans(xj), acc, input_precision=FP32_DOT)
    # the upper triangle of the whole matrix: all of an off-diagonal block, half of a diagonal one
    upper = (ri[:, None] <= rj[None, :]) & (rj[None, :] < rows)
    block = matrix * rows * rows + ri[:, None] * rows + rj[None, :]
    mirror = matrix * rows * rows + rj[None, :] * rows + ri[:, None]
    acc = alpha * acc
    if HAS_CIN:
        acc += beta * tl.load(cin_ptr + block, mask=upper, other=0.0).to(tl.float32)
    tl.store(out_ptr + block, acc, mask=upper)
    tl.store(out_ptr + mirror, acc, mask=upper)


def _check(name: str, x: torch.Tensor, like: torch.Tensor | None = None, fits_tile: bool = True) -> None:
    """Raise a ValueError / TypeError naming `name` unless x suits the kernels (`like`: same
    shape and device; `fits_tile`: matrices within the per-matrix limit)."""
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{name} is on {x.device}: the Triton kernels need a CUDA device (or TRITON_INTERPRET=1); "
                         "use backend='torch'")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{name} must be float32 or bfloat16, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{name} must be (..., rows, cols), got shape {tuple(x.shape)}")
    if like is not None and (x.shape != like.shape or x.device != like.device):
        raise ValueError(f"{name} has shape {tuple(x.shape)} on {x.device}; expected {tuple(like.shape)} on {like.device}")
    small, large = sorted(x.shape[-2:])
    if fits_tile and (small > MAX_ROWS or large > MAX_COLS):
        raise ValueError(f"{name} matrices {tuple(x.shape[-2:])} exceed {MAX_ROWS} x {MAX_COLS}; "
                         "use newton_schulz_blocked or the torch reference")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")


def _check_block(name: str, block: int) -> None:
    if block < 16 or block & (block - 1):
        raise ValueError(f"{name}: block must be a power of two >= 16 (tl.dot's smallest tile), got {block}")


def _coefficients(coefficients, steps: int, like: torch.Tensor) -> torch.Tensor:
    """The (steps, 3) fp32 schedule on the input's device (at least one row for steps = 0)."""
    schedule = coefficient_schedule(coefficients, steps) or (MUON_COEFFICIENTS,)
    return torch.tensor(schedule, dtype=torch.float32, device=like.device)


def _oriented(x: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """(batch, rows, cols, stride_b, stride_r, stride_c) reading x (..., r, c) as a batch of
    matrices with rows <= cols: tall ones transposed, through swapped strides."""
    flat = x.view(-1, *x.shape[-2:])
    batch, rows, cols = flat.shape
    stride_b, stride_r, stride_c = flat.stride()
    if rows > cols:
        return batch, cols, rows, stride_b, stride_c, stride_r
    return batch, rows, cols, stride_b, stride_r, stride_c


def _launch_geometry(x: torch.Tensor):
    """Per-matrix launch: grid (batch,), the fp32 workspace (batch, rows, cols), (rows, cols,
    strides) as `_oriented`, and block sizes and launch options."""
    batch, rows, cols, *strides = _oriented(x)
    block_rows = max(16, triton.next_power_of_2(rows))
    blocks = {"BLOCK_R": block_rows, "BLOCK_K": 32 if block_rows > 64 else 64, "num_warps": 8 if block_rows > 64 else 4,
              "PRECISION": FP32_DOT_PRECISION if x.dtype == torch.float32 else "tf32"}
    workspace = torch.empty(batch, rows, cols, dtype=torch.float32, device=x.device)
    return (batch,), workspace, (rows, cols, *strides), blocks


@functools.cache
def upper_block_pairs(n_blocks: int, device: torch.device) -> torch.Tensor:
    """(2, n (n + 1) / 2) int32 on `device`: block row i (first row) and block column j (second
    row) of every upper-triangular block pair i <= j, row by row."""
    return torch.triu_indices(n_blocks, n_blocks, dtype=torch.int32, device=device)


def symmetric_gram(x: torch.Tensor, cin: torch.Tensor | None = None, alpha: float = 1.0, beta: float = 0.0,
                   block: int = 64) -> torch.Tensor:
    """beta * cin + alpha * X X^T for each matrix X of x (..., r, c) read with rows <= cols
    (tall ones as X^T, through swapped strides), computing only the upper-triangular
    `block` x `block` blocks and mirroring them. x fp32 or bf16, contiguous; cin None or
    symmetric (..., n, n), n = min(r, c), contiguous (only its upper triangle is read).
    Returns (..., n, n) fp32, exactly symmetric."""
    _check("symmetric_gram: x", x, fits_tile=False)
    _check_block("symmetric_gram", block)
    batch, rows, cols, *strides = _oriented(x)
    out = torch.empty(*x.shape[:-2], rows, rows, dtype=torch.float32, device=x.device)
    if cin is not None:
        _check("symmetric_gram: cin", cin, out, fits_tile=False)
    pairs = upper_block_pairs(triton.cdiv(rows, block), x.device)
    _symmetric_gram_kernel[(batch, pairs.shape[1])](x, out if cin is None else cin, out, pairs, pairs.shape[1], rows,
                                                     cols, *strides, alpha, beta, HAS_CIN=cin is not None,
                                                     BLOCK=block, BLOCK_K=block)
    return out


def _newton_schulz_tile(x: torch.Tensor, schedule) -> torch.Tensor:
    """The whole iteration in one program per matrix; x (..., rows, cols) -> same shape and dtype."""
    out = torch.empty_like(x)
    grid, workspace, geometry, blocks = _launch_geometry(x)
    _newton_schulz_kernel[grid](x, workspace, out, *geometry, _coefficients(schedule, len(schedule), x), STEPS=len(schedule),
                                **blocks)
    return out


def _newton_schulz_blocks(x: torch.Tensor, schedule, block: int) -> torch.Tensor:
    """Per step: Gram products by `symmetric_gram`, the update by torch in fp32; x (..., rows,
    cols) -> same shape and dtype. Tall X is iterated in its own layout: for W = X^T the
    reference's W <- a W + B W is X <- a X + X B (B symmetric)."""
    work = x.float()
    work = (work / (torch.linalg.matrix_norm(work, keepdim=True) + 1e-7)).view(-1, *x.shape[-2:])
    tall = work.shape[-2] > work.shape[-1]
    for a, b, c in schedule:
        gram = symmetric_gram(work, block=block)
        poly = symmetric_gram(gram, gram, alpha=c, beta=b, block=block)
        work = torch.baddbmm(work, work, poly, beta=a) if tall else torch.baddbmm(work, poly, work, beta=a)
    return work.view(x.shape).to(x.dtype)


class _NewtonSchulz(torch.autograd.Function):
    """Forward by the per-matrix kernel (block None) or the blocked path (square blocks of
    `block` rows); backward by recomputing the torch reference."""

    @staticmethod
    def forward(ctx, x, steps, coefficients, block):
        ctx.save_for_backward(x)
        ctx.steps, ctx.coefficients = steps, coefficients
        return _newton_schulz_tile(x, coefficients) if block is None else _newton_schulz_blocks(x, coefficients, block)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            (dx,) = torch.autograd.grad(newton_schulz_reference(leaf, ctx.steps, ctx.coefficients), leaf, grad)
        return dx, None, None, None


class _MemoryUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, momentum, grad, eta, alpha, steps, step_scale, coefficients):
        _check("memory_update_triton: weight", weight)
        _check("memory_update_triton: momentum", momentum, weight)
        _check("memory_update_triton: grad", grad, weight)
        for name, gate in (("eta", eta), ("alpha", alpha)):
            if gate.shape != weight.shape[:-2]:
                raise ValueError(f"memory_update_triton: {name} has shape {tuple(gate.shape)}; expected {tuple(weight.shape[:-2])}")
        ctx.save_for_backward(weight, momentum, grad, eta, alpha)
        ctx.steps, ctx.step_scale, ctx.coefficients = steps, step_scale, coefficients
        new_weight, new_momentum = torch.empty_like(weight), torch.empty_like(momentum)
        grid, workspace, geometry, blocks = _launch_geometry(weight)
        _memory_update_kernel[grid](weight, momentum, grad, eta.contiguous(), alpha.contiguous(), workspace, new_weight,
                                    new_momentum, *geometry, _coefficients(coefficients, steps, weight), float(step_scale),
                                    STEPS=steps,
                                    **blocks)
        return new_weight, new_momentum

    @staticmethod
    def backward(ctx, grad_weight, grad_momentum):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in ctx.saved_tensors]
            outputs = memory_update_reference(*leaves, ctx.steps, ctx.step_scale, ctx.coefficients)
            grads = torch.autograd.grad(outputs, leaves, (grad_weight, grad_momentum), allow_unused=True)
        return (*grads, None, None, None)


def newton_schulz_triton(x: torch.Tensor, steps: int = 5, coefficients=MUON_COEFFICIENTS) -> torch.Tensor:
    """Same contract as `kernels.reference.newton_schulz_reference`, on a Triton device (or under
    TRITON_INTERPRET=1 on CPU). x (..., rows, cols), contiguous, fp32 or bf16, each matrix
    within MAX_ROWS x MAX_COLS (either orientation): the per-matrix kernel."""
    _check("newton_schulz_triton: x", x)
    return _NewtonSchulz.apply(x, steps, coefficient_schedule(coefficients, steps), None)


def newton_schulz_blocked(x: torch.Tensor, steps: int = 5, coefficients=MUON_COEFFICIENTS,
                          block: int = 64) -> torch.Tensor:
    """As `newton_schulz_triton` for matrices of any size: the blocked path, Gram products
    in square blocks of `block` rows (a power of two >= 16), upper triangle only."""
    _check("newton_schulz_blocked: x", x, fits_tile=False)
    _check_block("newton_schulz_blocked", block)
    return _NewtonSchulz.apply(x, steps, coefficient_schedule(coefficients, steps), block)


def memory_update_triton(weight, momentum, grad, eta, alpha, steps: int, step_scale: float = 1.0,
                         coefficients=MUON_COEFFICIENTS):
    """Same contract as `kernels.reference.memory_update_reference`, fused in one kernel."""
    return _MemoryUpdate.apply(weight, momentum, grad, eta, alpha, steps, step_scale,
                               coefficient_schedule(coefficients, steps))
