"""Triton kernels for Newton-Schulz orthogonalisation and the fused memory-update step.

One program holds one whole matrix (oriented so that rows <= cols, by reading it through
swapped strides: no transpose copies; rows <= 128, cols <= 512, the sizes of the
memories' fast weights) in registers, and runs the Frobenius normalisation and all
`steps` quintic iterations (`kernels/newton_schulz.py` states the iteration) without
leaving the chip. The fused update (`kernels/memory_update.py` states it) also reads the
weight, momentum and gradient and writes the new weight and momentum in the same program.
Inputs fp32 or bf16, accumulation in fp32 (fp32 dots in IEEE precision, not TF32).

Backward: recompute. It re-runs the torch reference under autograd and differentiates
it, storing nothing but the inputs (saving the `steps` iterates instead would keep
`steps` extra copies of every momentum matrix, for a backward that is small next to the
memory's forward and backward).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.memory_update import memory_update_reference
from kernels.newton_schulz import coefficient_schedule, MUON_COEFFICIENTS, newton_schulz

MAX_ROWS, MAX_COLS = 128, 512


@triton.jit
def _orthogonalise(x, coef_ptr, STEPS: tl.constexpr, PRECISION: tl.constexpr):
    """Newton-Schulz on a register tile x (rows <= cols), fp32; coef_ptr: (STEPS, 3)."""
    x = x / (tl.sqrt(tl.sum(tl.sum(x * x, axis=1), axis=0)) + 1e-7)
    for i in tl.static_range(STEPS):
        a = tl.load(coef_ptr + 3 * i)
        b = tl.load(coef_ptr + 3 * i + 1)
        c = tl.load(coef_ptr + 3 * i + 2)
        gram = tl.dot(x, tl.trans(x), input_precision=PRECISION)
        poly = b * gram + c * tl.dot(gram, gram, input_precision=PRECISION)
        x = a * x + tl.dot(poly, x, input_precision=PRECISION)
    return x


@triton.jit
def _matrix_tile(matrix, rows, cols, stride_b, stride_r, stride_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Element offsets of this program's matrix, read as (rows, cols), and the in-bounds mask."""
    r = tl.arange(0, BLOCK_R)[:, None]
    col = tl.arange(0, BLOCK_C)[None, :]
    return matrix * stride_b + r * stride_r + col * stride_c, (r < rows) & (col < cols)


@triton.jit
def _newton_schulz_kernel(x_ptr, out_ptr, rows, cols, stride_b, stride_r, stride_c, coef_ptr,
                          STEPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr):
    matrix = tl.program_id(0)
    offsets, inside = _matrix_tile(matrix, rows, cols, stride_b, stride_r, stride_c, BLOCK_R, BLOCK_C)
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    x = _orthogonalise(x, coef_ptr, STEPS, PRECISION)
    tl.store(out_ptr + offsets, x.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _memory_update_kernel(w_ptr, s_ptr, g_ptr, eta_ptr, alpha_ptr, w_out_ptr, s_out_ptr, rows, cols,
                          stride_b, stride_r, stride_c, coef_ptr,
                          STEPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr):
    matrix = tl.program_id(0)
    offsets, inside = _matrix_tile(matrix, rows, cols, stride_b, stride_r, stride_c, BLOCK_R, BLOCK_C)
    eta = tl.load(eta_ptr + matrix).to(tl.float32)
    retain = 1.0 - tl.load(alpha_ptr + matrix).to(tl.float32)
    s = eta * tl.load(s_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    s = s - tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(s_out_ptr + offsets, s.to(s_out_ptr.dtype.element_ty), mask=inside)
    if STEPS > 0:
        s = _orthogonalise(s, coef_ptr, STEPS, PRECISION)
    w = retain * tl.load(w_ptr + offsets, mask=inside, other=0.0).to(tl.float32) + s
    tl.store(w_out_ptr + offsets, w.to(w_out_ptr.dtype.element_ty), mask=inside)


def _check(name: str, x: torch.Tensor, like: torch.Tensor | None = None) -> None:
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
    if small > MAX_ROWS or large > MAX_COLS:
        raise ValueError(f"{name} matrices {tuple(x.shape[-2:])} exceed {MAX_ROWS} x {MAX_COLS}; use the torch reference")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")


def _coefficients(coefficients, steps: int, like: torch.Tensor) -> torch.Tensor:
    """The (steps, 3) fp32 schedule on the input's device (at least one row for steps = 0)."""
    schedule = coefficient_schedule(coefficients, steps) or (MUON_COEFFICIENTS,)
    return torch.tensor(schedule, dtype=torch.float32, device=like.device)


def _launch_geometry(x: torch.Tensor):
    """(batch, rows, cols, strides) reading each matrix so that rows <= cols, and block sizes."""
    flat = x.view(-1, *x.shape[-2:])
    batch, rows, cols = flat.shape
    stride_b, stride_r, stride_c = flat.stride()
    if rows > cols:  # tall: read transposed through swapped strides
        rows, cols, stride_r, stride_c = cols, rows, stride_c, stride_r
    blocks = dict(BLOCK_R=max(16, triton.next_power_of_2(rows)), BLOCK_C=max(16, triton.next_power_of_2(cols)),
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return (batch,), (rows, cols, stride_b, stride_r, stride_c), blocks


class _NewtonSchulz(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, steps, coefficients):
        _check("newton_schulz_triton: x", x)
        ctx.save_for_backward(x)
        ctx.steps, ctx.coefficients = steps, coefficients
        out = torch.empty_like(x)
        grid, geometry, blocks = _launch_geometry(x)
        _newton_schulz_kernel[grid](x, out, *geometry, _coefficients(coefficients, steps, x), STEPS=steps, **blocks)
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            (dx,) = torch.autograd.grad(newton_schulz(leaf, ctx.steps, ctx.coefficients), leaf, grad)
        return dx, None, None


class _MemoryUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, momentum, grad, eta, alpha, steps, coefficients):
        _check("memory_update_triton: weight", weight)
        _check("memory_update_triton: momentum", momentum, weight)
        _check("memory_update_triton: grad", grad, weight)
        for name, gate in (("eta", eta), ("alpha", alpha)):
            if gate.shape != weight.shape[:-2]:
                raise ValueError(f"memory_update_triton: {name} has shape {tuple(gate.shape)}; expected {tuple(weight.shape[:-2])}")
        ctx.save_for_backward(weight, momentum, grad, eta, alpha)
        ctx.steps, ctx.coefficients = steps, coefficients
        new_weight, new_momentum = torch.empty_like(weight), torch.empty_like(momentum)
        grid, geometry, blocks = _launch_geometry(weight)
        _memory_update_kernel[grid](weight, momentum, grad, eta.contiguous(), alpha.contiguous(), new_weight,
                                    new_momentum, *geometry, _coefficients(coefficients, steps, weight), STEPS=steps,
                                    **blocks)
        return new_weight, new_momentum

    @staticmethod
    def backward(ctx, grad_weight, grad_momentum):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in ctx.saved_tensors]
            outputs = memory_update_reference(*leaves, ctx.steps, ctx.coefficients)
            grads = torch.autograd.grad(outputs, leaves, (grad_weight, grad_momentum), allow_unused=True)
        return (*grads, None, None)


def newton_schulz_triton(x: torch.Tensor, steps: int = 5, coefficients=MUON_COEFFICIENTS) -> torch.Tensor:
    """Same contract as `kernels.newton_schulz.newton_schulz`, on a Triton device (or under
    TRITON_INTERPRET=1 on CPU). x (..., rows, cols), contiguous, fp32 or bf16."""
    return _NewtonSchulz.apply(x, steps, coefficient_schedule(coefficients, steps))


def memory_update_triton(weight, momentum, grad, eta, alpha, steps: int, coefficients=MUON_COEFFICIENTS):
    """Same contract as `kernels.memory_update.memory_update_reference`, fused in one kernel."""
    return _MemoryUpdate.apply(weight, momentum, grad, eta, alpha, steps, coefficient_schedule(coefficients, steps))
