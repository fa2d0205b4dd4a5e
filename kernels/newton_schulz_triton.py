"""Newton-Schulz orthogonalisation as one Triton kernel per batch of matrices.

One program holds one whole matrix (after the wide/tall transpose: rows <= cols, rows <=
128, cols <= 512, the sizes of the memories' fast weights) in registers, normalises it by
its Frobenius norm and runs all `steps` quintic iterations (`kernels/newton_schulz.py`
states the iteration) without leaving the chip: one launch instead of 5 x 4 matmuls.
Inputs fp32 or bf16, accumulation in fp32 (fp32 dots in IEEE precision, not TF32).

Backward: recompute. The backward re-runs the torch reference under autograd and
differentiates it; it stores nothing but the input (the alternative, saving the `steps`
iterates, costs `steps` extra copies of every momentum matrix for a backward that is
small next to the memory's forward/backward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.newton_schulz import MUON_COEFFICIENTS, newton_schulz

MAX_ROWS, MAX_COLS = 128, 512


@triton.jit
def _newton_schulz_kernel(x_ptr, out_ptr, rows, cols, stride_b, stride_r, stride_c, a, b, c,
                          STEPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr):
    matrix = tl.program_id(0)
    r = tl.arange(0, BLOCK_R)[:, None]
    col = tl.arange(0, BLOCK_C)[None, :]
    inside = (r < rows) & (col < cols)
    offsets = matrix * stride_b + r * stride_r + col * stride_c
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    x = x / (tl.sqrt(tl.sum(tl.sum(x * x, axis=1), axis=0)) + 1e-7)
    for _ in tl.static_range(STEPS):
        gram = tl.dot(x, tl.trans(x), input_precision=PRECISION)
        poly = b * gram + c * tl.dot(gram, gram, input_precision=PRECISION)
        x = a * x + tl.dot(poly, x, input_precision=PRECISION)
    tl.store(out_ptr + offsets, x.to(out_ptr.dtype.element_ty), mask=inside)


def _check(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"newton_schulz_triton: x must be float32 or bfloat16, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"newton_schulz_triton: x must be (..., rows, cols), got shape {tuple(x.shape)}")
    small, large = sorted(x.shape[-2:])
    if small > MAX_ROWS or large > MAX_COLS:
        raise ValueError(f"newton_schulz_triton: x matrices {tuple(x.shape[-2:])} exceed {MAX_ROWS} x {MAX_COLS}; "
                         "use kernels.newton_schulz.newton_schulz")
    if not x.is_contiguous():
        raise ValueError("newton_schulz_triton: x must be contiguous (call .contiguous())")


def _forward(x: torch.Tensor, steps: int, coefficients) -> torch.Tensor:
    _check(x)
    tall = x.shape[-2] > x.shape[-1]
    work = (x.transpose(-1, -2) if tall else x).contiguous().reshape(-1, *sorted(x.shape[-2:]))
    out = torch.empty_like(work)
    batch, rows, cols = work.shape
    block_r = max(16, triton.next_power_of_2(rows))
    block_c = max(16, triton.next_power_of_2(cols))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _newton_schulz_kernel[(batch,)](work, out, rows, cols, *work.stride(), *coefficients,
                                    STEPS=steps, BLOCK_R=block_r, BLOCK_C=block_c, PRECISION=precision)
    out = out.reshape(*x.shape[:-2], rows, cols)
    return out.transpose(-1, -2) if tall else out


class _NewtonSchulz(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, steps, coefficients):
        ctx.save_for_backward(x)
        ctx.steps, ctx.coefficients = steps, coefficients
        return _forward(x, steps, coefficients)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            (dx,) = torch.autograd.grad(newton_schulz(leaf, ctx.steps, ctx.coefficients), leaf, grad)
        return dx, None, None


def newton_schulz_triton(x: torch.Tensor, steps: int = 5, coefficients=MUON_COEFFICIENTS) -> torch.Tensor:
    """Same contract as `kernels.newton_schulz.newton_schulz`, on a Triton device (or under
    TRITON_INTERPRET=1 on CPU). x (..., rows, cols), contiguous, fp32 or bf16."""
    return _NewtonSchulz.apply(x, steps, tuple(coefficients))
