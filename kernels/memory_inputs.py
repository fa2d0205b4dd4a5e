"""The neural memory's chunk inputs in one launch: from its q/k/v projection and gate logits to
the whole-sequence kernels' inputs (kernels/whole_sequence.py), for the one-step-per-chunk rule
(Mela's; models/memory/neural_memory.py states the layer) without a convolution.

From qkv (B, T, 3 H d) (`to_qkv`'s output: q, k, v side by side, each H heads of d) and gate
logits (B, T, 3 H) (`to_gates`' output before its bias: theta, eta, alpha logits), T = N C:

    q, k = normalize(silu(.)) per head and token (`qk_norm`; else as projected)
    v = silu(.) (`value_silu`; else as projected)
    theta_t = max_lr sigmoid(l_theta + b_theta),  eta_t = sigmoid(l_eta + b_eta)  (0 without momentum)
    alpha_t = 1 - sigmoid(-(l_alpha + b_alpha + offset))  (0 without forgetting)
    token weights (B, H, N, C, 1) = 2 theta_t,  decays (B, H, N, 2) = (mean_c eta_t, mean_c alpha_t)

q, k, v come out (B, H, N, C, d), everything float32 (float64 in the torch reference for
float64 inputs). These are `NeuralMemory._query_heads`, `_gates` and `chunk_gates(..., "chunk")`
(models/memory/chunk_write.py) composed: the layer computes them so on every other path, in
about eleven kernels under Inductor. Values the layer keeps in the activation dtype (q, k, v and
the biased logits, e.g. bf16 under autocast) are rounded to it here too before the float32 cast.

`chunk_inputs` runs `memory_inputs::chunk_inputs`, a custom op torch.compile keeps opaque (one
launch on a GPU: kernels/memory_inputs_triton.py; under TRITON_INTERPRET=1 the same kernel on
the CPU; elsewhere the torch reference `chunk_inputs_reference`), with a meta implementation and
a backward in plain torch ops (`_backward`, the derivatives of the formulas above, traced into
the compiled backward graph where Inductor fuses it). The rounding to the activation dtype is
the identity in backward, as autograd's is for a cast.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels.reference import silu_grad

try:
    import triton

    from kernels import memory_inputs_triton as _kernels
except ImportError:  # the torch reference needs no triton (a Hugging Face export ships without it)
    triton = _kernels = None

NORM_EPS = 1e-12  # F.normalize's


def _layout(t: torch.Tensor, heads: int, chunk: int) -> torch.Tensor:
    """(B, T, H d) -> (B, H, N, C, d)."""
    return t.unflatten(-1, (heads, -1)).transpose(1, 2).unflatten(2, (-1, chunk))


def _unlayout(t: torch.Tensor) -> torch.Tensor:
    """(B, H, N, C, ...) -> (B, T, H, ...)."""
    return t.flatten(2, 3).transpose(1, 2)


def chunk_inputs_reference(qkv, gate_logits, bias, heads: int, chunk: int, max_lr: float, forget_offset: float,
                           qk_norm: bool = True, value_silu: bool = False, momentum: bool = True, forget: bool = True):
    """The module docstring's formulas in plain torch: (q, k, v (B, H, N, C, d), token weights
    (B, H, N, C, 1), decays (B, H, N, 2)) in float32 (float64 for float64 inputs)."""
    out = torch.promote_types(qkv.dtype, torch.float32)
    q, k, v = qkv.to(out).chunk(3, -1)
    if qk_norm:
        q, k = (F.normalize(F.silu(_layout(t, heads, chunk)), dim=-1) for t in (q, k))
    else:
        q, k = _layout(q, heads, chunk), _layout(k, heads, chunk)
    v = _layout(F.silu(v) if value_silu else v, heads, chunk)
    q, k, v = (t.to(qkv.dtype).to(out) for t in (q, k, v))
    logits = gate_logits if bias is None else (gate_logits.to(out) + bias.to(out)).to(gate_logits.dtype)
    theta, eta, alpha = logits.to(out).unflatten(-1, (3, heads)).permute(2, 0, 3, 1).unflatten(-1, (-1, chunk))
    eta = torch.sigmoid(eta) if momentum else torch.zeros_like(eta)
    alpha = 1 - torch.sigmoid(-(alpha + forget_offset)) if forget else torch.zeros_like(alpha)
    return q, k, v, (2 * max_lr * torch.sigmoid(theta))[..., None], torch.stack([eta, alpha], -1).mean(-2)


def _shape_problem(qkv: torch.Tensor, gate_logits: torch.Tensor, heads: int, chunk: int) -> str | None:
    """What is wrong with the shapes (None when they fit)."""
    batch, length, width = qkv.shape
    if width % (3 * heads) or tuple(gate_logits.shape) != (batch, length, 3 * heads) or length % chunk:
        return (f"qkv {tuple(qkv.shape)}, gate logits {tuple(gate_logits.shape)}, heads {heads}, chunk {chunk}: "
                f"expected (B, T, 3 H d) and (B, T, 3 H) with T a multiple of the chunk")
    return None


def refusal(qkv: torch.Tensor, gate_logits: torch.Tensor, heads: int, chunk: int) -> str | None:
    """Why `chunk_inputs` cannot take these inputs on the Triton kernel (None when it can)."""
    if _kernels is None:
        return "triton is not installed"
    if qkv.device.type not in ("cuda", "meta") and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the inputs are on {qkv.device}: the kernel needs a CUDA device (or TRITON_INTERPRET=1)"
    if qkv.dtype not in (torch.float32, torch.bfloat16, torch.float16) or gate_logits.dtype != qkv.dtype:
        return f"qkv {qkv.dtype}, gate logits {gate_logits.dtype}: the kernel takes one of float32 / bfloat16 / float16"
    if (problem := _shape_problem(qkv, gate_logits, heads, chunk)) is not None:
        return problem
    if qkv.stride(-1) != 1 or gate_logits.stride(-1) != 1:
        return "qkv and gate logits need unit feature strides"
    return None


def _empty_outputs(qkv: torch.Tensor, heads: int, chunk: int):
    batch, length, width = qkv.shape
    fp32 = dict(dtype=torch.promote_types(qkv.dtype, torch.float32), device=qkv.device)
    tiles = (batch, heads, length // chunk, chunk)
    return (*(torch.empty(*tiles, width // (3 * heads), **fp32) for _ in range(3)), torch.empty(*tiles, 1, **fp32),
            torch.empty(*tiles[:3], 2, **fp32))


@torch.library.custom_op("memory_inputs::chunk_inputs", mutates_args=())
def _op(qkv: torch.Tensor, gate_logits: torch.Tensor, bias: torch.Tensor | None, heads: int, chunk: int,
        max_lr: float, forget_offset: float, qk_norm: bool, value_silu: bool, momentum: bool, forget: bool
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module docstring's outputs: one Triton launch where `refusal` allows, else the torch reference."""
    flags = (qk_norm, value_silu, momentum, forget)
    if refusal(qkv, gate_logits, heads, chunk) is not None:
        return tuple(t.contiguous() for t in chunk_inputs_reference(qkv, gate_logits, bias, heads, chunk, max_lr,
                                                                      forget_offset, *flags))
    q, k, v, token_weights, decays = _empty_outputs(qkv, heads, chunk)
    batch, heads, chunks, _, dim = q.shape
    _kernels.chunk_inputs_fwd[(batch * heads * chunks,)](
        qkv, gate_logits, qkv if bias is None else bias, q, k, v, token_weights, decays,
        qkv.stride(0), qkv.stride(1), gate_logits.stride(0), gate_logits.stride(1), heads, chunks, chunk, dim,
        float(max_lr), float(forget_offset), HAS_BIAS=bias is not None, QK_NORM=qk_norm, VALUE_SILU=value_silu,
        MOMENTUM=momentum, FORGET=forget, ROUND=qkv.dtype != torch.float32,
        BC=triton.next_power_of_2(chunk), BD=triton.next_power_of_2(dim))
    return q, k, v, token_weights, decays


@_op.register_fake
def _(qkv, gate_logits, bias, heads, chunk, max_lr, forget_offset, qk_norm, value_silu, momentum, forget):
    return _empty_outputs(qkv, heads, chunk)


def _setup_context(ctx, inputs, output):
    qkv, gate_logits, bias, *options = inputs
    ctx.save_for_backward(qkv, gate_logits, bias)
    ctx.options = options


def _normalized_silu_grad(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """d/dx of <grad, normalize(silu(x))> over the last dim: with s = silu(x), n = max(||s||, eps),
    u = s / n: (grad - u <grad, u> [||s|| > eps]) / n times silu'(x)."""
    s = F.silu(x)
    norm = s.norm(dim=-1, keepdim=True)
    n = norm.clamp_min(NORM_EPS)
    u = s / n
    radial = torch.where(norm > NORM_EPS, u * (grad * u).sum(-1, keepdim=True), 0)
    return (grad - radial) / n * silu_grad(x)


def _backward(ctx, dq, dk, dv, d_token_weights, d_decays):
    """Gradients to qkv, the gate logits and their bias (module docstring's formulas
    differentiated; an unused output's gradient arrives as None and counts as zero)."""
    qkv, gate_logits, bias = ctx.saved_tensors
    heads, chunk, max_lr, forget_offset, qk_norm, value_silu, momentum, forget = ctx.options
    out = torch.promote_types(qkv.dtype, torch.float32)
    x = qkv.to(out).unflatten(-1, (3, heads, -1))  # (B, T, 3, H, d)
    zeros = x.new_zeros(x.shape[:2] + x.shape[3:])

    def head_grad(grad, part, norm, silu):
        if grad is None:
            return zeros
        grad = _unlayout(grad.to(out))
        if norm:
            return _normalized_silu_grad(x[:, :, part], grad)
        return grad * silu_grad(x[:, :, part]) if silu else grad

    d_qkv = torch.stack([head_grad(dq, 0, qk_norm, qk_norm), head_grad(dk, 1, qk_norm, qk_norm),
                         head_grad(dv, 2, False, value_silu)], 2).flatten(2)
    logits = gate_logits.to(out) if bias is None else gate_logits.to(out) + bias.to(out)
    theta, eta, alpha = logits.unflatten(-1, (3, heads)).unbind(2)  # (B, T, H) each
    length = theta.shape[1]
    d_theta = (torch.zeros_like(theta) if d_token_weights is None else
               _unlayout(d_token_weights.to(out))[..., 0] * 2 * max_lr * _sigmoid_grad(theta))
    if d_decays is None:
        d_decays = theta.new_zeros(theta.shape[0], heads, length // chunk, 2)
    per_token = _unlayout(d_decays.to(out)[:, :, :, None].expand(-1, -1, -1, chunk, -1)) / chunk  # (B, T, H, 2)
    d_eta = per_token[..., 0] * _sigmoid_grad(eta) if momentum else torch.zeros_like(eta)
    d_alpha = per_token[..., 1] * _sigmoid_grad(alpha + forget_offset) if forget else torch.zeros_like(alpha)
    d_logits = torch.cat([d_theta, d_eta, d_alpha], -1)
    d_bias = None if bias is None else d_logits.sum((0, 1)).to(bias.dtype)
    return (d_qkv.to(qkv.dtype), d_logits.to(gate_logits.dtype), d_bias) + (None,) * 8


def _sigmoid_grad(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1 - s)


torch.library.register_autograd("memory_inputs::chunk_inputs", _backward, setup_context=_setup_context)


def chunk_inputs(qkv, gate_logits, bias, heads: int, chunk: int, max_lr: float, forget_offset: float,
                 qk_norm: bool = True, value_silu: bool = False, momentum: bool = True, forget: bool = True):
    """The module docstring's (q, k, v, token weights, decays) through the custom op (one launch
    where `refusal` allows; the torch reference elsewhere). qkv (B, T, 3 H d), gate_logits
    (B, T, 3 H) without `bias` (3 H, or None); ValueError naming the shapes where they do not fit."""
    if (problem := _shape_problem(qkv, gate_logits, heads, chunk)) is not None:
        raise ValueError(f"chunk_inputs: {problem}")
    return _op(qkv, gate_logits, bias, heads, chunk, float(max_lr), float(forget_offset), qk_norm, value_silu,
               momentum, forget)
