"""The neural memory's chunk inputs in one launch: from its q/k/v projection and gate logits to
the whole-sequence kernels' inputs (kernels/whole_sequence.py), for either write rule
(models/memory/neural_memory.py states the layer): Mela's one step per chunk without a
convolution, and Titans' per-token rule after its causal depthwise convolution.

From qkv (B, T, 3 H d) (`to_qkv`'s output: q, k, v side by side, each H heads of d) and gate
logits (B, T, 3 H) (`to_gates`' output before its bias: theta, eta, alpha logits), T = N C:

    with a conv (weight (3 H d, 1, K), history h (B, K-1, 3 H d): the K-1 projections before):
        x_t = sum_j w_j [h; qkv]_{t+j}   per channel (the layer's `_convolve`), else x = qkv
    q, k = normalize(silu(.)) per head and token (`qk_norm`; else as convolved)
    v = silu(.) (`value_silu`; else as convolved)
    theta_t = max_lr sigmoid(l_theta + b_theta),  eta_t = sigmoid(l_eta + b_eta)  (0 without momentum)
    alpha_t = 1 - sigmoid(-(l_alpha + b_alpha + offset))  (0 without forgetting)
    gates "chunk": token weights (B, H, N, C, 1) = 2 theta_t,  decays (B, H, N, 2) = (mean_c eta_t, mean_c alpha_t)
    gates "token": over a chunk's tokens 1..C (0 = the chunk start), P[t, i] = prod_{i<j<=t} eta_j,
        R_t = prod_{t<j<=C} (1 - alpha_j):
        token weights (B, H, N, C, 2) = -2 theta_i (sum_{t>=i} R_t P[t, i], P[C, i]),
        decays (B, H, N, 2, 2) = [[R_0, sum_{t>=1} R_t P[t, 0]], [0, P[C, 0]]]

q, k, v come out (B, H, N, C, d), everything float32 (float64 in the torch reference for
float64 inputs). These are `NeuralMemory._convolve`, `_query_heads`, `_gates` and `chunk_gates`
(models/memory/chunk_write.py) composed: the layer computes them so on every other path, in
about eleven kernels under Inductor (seventeen a call with Titans' conv and per-token rule).
Values the layer keeps in the activation dtype (the convolved projections, q, k, v and the
biased logits, e.g. bf16 under autocast) are rounded to it here too before the float32 cast.

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
# Warps per program of both kernels: at the paper shape (head_dim 64, chunk 64) under bf16 autocast, compiled for
# sm_90 (scripts/compile_kernels.py, 2026-12-04, Triton 3.9), Titans' variants (conv, per-token rule) spill up to
# 2,480 / 5,000 B (forward) and 3,548 / 7,104 B (backward) a thread at Triton's default 4, none at 8.
NUM_WARPS = 8
GATES = ("chunk", "token")


def _layout(t: torch.Tensor, heads: int, chunk: int) -> torch.Tensor:
    """(B, T, H d) -> (B, H, N, C, d)."""
    return t.unflatten(-1, (heads, -1)).transpose(1, 2).unflatten(2, (-1, chunk))


def _unlayout(t: torch.Tensor) -> torch.Tensor:
    """(B, H, N, C, ...) -> (B, T, H, ...)."""
    return t.flatten(2, 3).transpose(1, 2)


def _conv_reference(qkv: torch.Tensor, weight: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """The causal depthwise conv of qkv (B, T, c) after history (B, K-1, c), weight (c, 1, K), by
    F.conv1d in float32 at least, rounded to qkv's dtype (as the layer keeps it)."""
    wide = torch.promote_types(qkv.dtype, torch.float32)
    padded = torch.cat([history.to(qkv.dtype), qkv], 1).to(wide)
    return F.conv1d(padded.transpose(1, 2), weight.to(wide), groups=qkv.shape[-1]).transpose(1, 2).to(qkv.dtype)


def _token_gates_reference(theta, eta, keep):
    """The per-token rule's weights and mix for gate values (B, H, N, C) (keep = 1 - alpha), by
    products accumulated token by token: (token weights (B, H, N, C, 2), decays (B, H, N, 2, 2))."""
    chunk = theta.shape[-1]
    rows = [F.pad(torch.ones_like(theta[..., :1]), (0, chunk))]  # P[0, i]: 1 at i = 0
    for t in range(1, chunk + 1):  # P[t, i] = P[t - 1, i] eta_t for i < t, P[t, t] = 1
        previous = rows[-1][..., :t] * eta[..., t - 1 : t]
        rows.append(torch.cat([previous, torch.ones_like(previous[..., :1]), rows[-1][..., t + 1 :]], -1))
    products = torch.stack(rows, -2)  # (..., C + 1, C + 1)
    to_end = [torch.ones_like(theta[..., 0])]  # R_C = 1, R_t = (1 - alpha_{t+1}) R_{t+1}
    for t in reversed(range(chunk)):
        to_end.insert(0, keep[..., t] * to_end[0])
    to_end = torch.stack(to_end, -1)  # (..., C + 1)
    weighted = to_end[..., :, None] * products  # [t, i] = R_t P[t, i]
    weight_weights = theta * weighted[..., 1:, 1:].sum(-2)
    momentum_weights = theta * products[..., -1, 1:]
    carried = weighted[..., 1:, 0].sum(-1)
    mix = torch.stack([to_end[..., 0], carried, torch.zeros_like(carried), products[..., -1, 0]], -1)
    return -2 * torch.stack([weight_weights, momentum_weights], -1), mix.unflatten(-1, (2, 2))


def chunk_inputs_reference(qkv, gate_logits, bias, heads: int, chunk: int, max_lr: float, forget_offset: float,
                           qk_norm: bool = True, value_silu: bool = False, momentum: bool = True, forget: bool = True,
                           gates: str = "chunk", conv_weight: torch.Tensor | None = None,
                           history: torch.Tensor | None = None):
    """The module docstring's formulas in plain torch: (q, k, v (B, H, N, C, d), token weights,
    decays) in float32 (float64 for float64 inputs)."""
    out = torch.promote_types(qkv.dtype, torch.float32)
    if conv_weight is not None:
        qkv = _conv_reference(qkv, conv_weight, history)
    q, k, v = qkv.to(out).chunk(3, -1)
    if qk_norm:
        q, k = (F.normalize(F.silu(_layout(t, heads, chunk)), dim=-1) for t in (q, k))
    else:
        q, k = _layout(q, heads, chunk), _layout(k, heads, chunk)
    v = _layout(F.silu(v) if value_silu else v, heads, chunk)
    q, k, v = (t.to(qkv.dtype).to(out) for t in (q, k, v))
    logits = gate_logits if bias is None else (gate_logits.to(out) + bias.to(out)).to(gate_logits.dtype)
    theta, eta, alpha = logits.to(out).unflatten(-1, (3, heads)).permute(2, 0, 3, 1).unflatten(-1, (-1, chunk))
    theta = max_lr * torch.sigmoid(theta)
    eta = torch.sigmoid(eta) if momentum else torch.zeros_like(eta)
    alpha = 1 - torch.sigmoid(-(alpha + forget_offset)) if forget else torch.zeros_like(alpha)
    if gates == "token":
        return q, k, v, *_token_gates_reference(theta, eta, 1 - alpha)
    return q, k, v, (2 * theta)[..., None], torch.stack([eta, alpha], -1).mean(-2)


def _shape_problem(qkv: torch.Tensor, gate_logits: torch.Tensor, heads: int, chunk: int, gates: str = "chunk",
                   conv_weight: torch.Tensor | None = None, history: torch.Tensor | None = None) -> str | None:
    """What is wrong with the shapes and options (None when they fit)."""
    batch, length, width = qkv.shape
    if width % (3 * heads) or tuple(gate_logits.shape) != (batch, length, 3 * heads) or length % chunk:
        return (f"qkv {tuple(qkv.shape)}, gate logits {tuple(gate_logits.shape)}, heads {heads}, chunk {chunk}: "
                f"expected (B, T, 3 H d) and (B, T, 3 H) with T a multiple of the chunk")
    if gates not in GATES:
        return f"gates '{gates}' unknown: choose one of {GATES}"
    if (conv_weight is None) != (history is None):
        return "a conv needs both its weight and its history (or neither)"
    if conv_weight is not None:
        taps = conv_weight.shape[-1]
        if tuple(conv_weight.shape) != (width, 1, taps) or tuple(history.shape) != (batch, taps - 1, width):
            return (f"conv weight {tuple(conv_weight.shape)}, history {tuple(history.shape)}: expected "
                    f"({width}, 1, K) and ({batch}, K - 1, {width})")
    return None


def refusal(qkv: torch.Tensor, gate_logits: torch.Tensor, heads: int, chunk: int, gates: str = "chunk",
            conv_weight: torch.Tensor | None = None, history: torch.Tensor | None = None) -> str | None:
    """Why `chunk_inputs` cannot take these inputs on the Triton kernel (None when it can)."""
    if _kernels is None:
        return "triton is not installed"
    if qkv.device.type not in ("cuda", "meta") and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the inputs are on {qkv.device}: the kernel needs a CUDA device (or TRITON_INTERPRET=1)"
    if qkv.dtype not in (torch.float32, torch.bfloat16, torch.float16) or gate_logits.dtype != qkv.dtype:
        return f"qkv {qkv.dtype}, gate logits {gate_logits.dtype}: the kernel takes one of float32 / bfloat16 / float16"
    if (problem := _shape_problem(qkv, gate_logits, heads, chunk, gates, conv_weight, history)) is not None:
        return problem
    if qkv.stride(-1) != 1 or gate_logits.stride(-1) != 1:
        return "qkv and gate logits need unit feature strides"
    if conv_weight is not None and (not conv_weight.is_contiguous() or history.stride(-1) != 1):
        return "the conv weight must be contiguous and its history of unit feature stride"
    return None


def _empty_outputs(qkv: torch.Tensor, heads: int, chunk: int, gates: str):
    batch, length, width = qkv.shape
    fp32 = dict(dtype=torch.promote_types(qkv.dtype, torch.float32), device=qkv.device)
    tiles = (batch, heads, length // chunk, chunk)
    weightings, decays = (2, (2, 2)) if gates == "token" else (1, (2,))
    return (*(torch.empty(*tiles, width // (3 * heads), **fp32) for _ in range(3)),
            torch.empty(*tiles, weightings, **fp32), torch.empty(*tiles[:3], *decays, **fp32))


@torch.library.custom_op("memory_inputs::chunk_inputs", mutates_args=())
def _op(qkv: torch.Tensor, gate_logits: torch.Tensor, bias: torch.Tensor | None, heads: int, chunk: int,
        max_lr: float, forget_offset: float, qk_norm: bool, value_silu: bool, momentum: bool, forget: bool,
        gates: str, conv_weight: torch.Tensor | None, history: torch.Tensor | None,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module docstring's outputs: one Triton launch where `refusal` allows, else the torch reference."""
    flags = (qk_norm, value_silu, momentum, forget, gates, conv_weight, history)
    if refusal(qkv, gate_logits, heads, chunk, gates, conv_weight, history) is not None:
        return tuple(t.contiguous() for t in chunk_inputs_reference(qkv, gate_logits, bias, heads, chunk, max_lr,
                                                                      forget_offset, *flags))
    outputs = _empty_outputs(qkv, heads, chunk, gates)
    _launch(_kernels.chunk_inputs_fwd, outputs, qkv, gate_logits, bias, conv_weight, history, heads, chunk,
            outputs[0].shape[-1], max_lr, forget_offset, qk_norm, value_silu, momentum, forget, gates)
    return outputs


def _launch(kernel, tensors, qkv, gate_logits, bias, conv_weight, history, heads: int, chunk: int, dim: int,
            max_lr: float, forget_offset: float, qk_norm: bool, value_silu: bool, momentum: bool, forget: bool,
            gates: str) -> None:
    """`kernel` (kernels/memory_inputs_triton.py `chunk_inputs_fwd` or `_bwd`) over one program per
    (batch, head, chunk): the layer's inputs, then `tensors` (the kernel's own), then sizes and switches."""
    conv = conv_weight is not None
    batch, length, _ = qkv.shape
    kernel[(batch * heads * (length // chunk),)](
        qkv, gate_logits, qkv if bias is None else bias, conv_weight if conv else qkv, history if conv else qkv,
        *tensors, qkv.stride(0), qkv.stride(1), gate_logits.stride(0), gate_logits.stride(1),
        history.stride(0) if conv else 0, history.stride(1) if conv else 0, heads, length // chunk, chunk, dim,
        float(max_lr), float(forget_offset), HAS_BIAS=bias is not None, QK_NORM=qk_norm, VALUE_SILU=value_silu,
        MOMENTUM=momentum, FORGET=forget, ROUND=qkv.dtype != torch.float32, TOKEN=gates == "token",
        TAPS=conv_weight.shape[-1] if conv else 0, BC=triton.next_power_of_2(chunk), BD=triton.next_power_of_2(dim),
        num_warps=NUM_WARPS)


@_op.register_fake
def _(qkv, gate_logits, bias, heads, chunk, max_lr, forget_offset, qk_norm, value_silu, momentum, forget, gates,
      conv_weight, history):
    return _empty_outputs(qkv, heads, chunk, gates)


def _setup_context(ctx, inputs, output):
    qkv, gate_logits, bias, *options, conv_weight, history = inputs
    ctx.save_for_backward(qkv, gate_logits, bias, conv_weight, history)
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


def _convolved(qkv, weight, history, wide: torch.dtype):
    """The conv as shifted products in `wide` (the backward's recomputation): ([h; qkv] (B, K-1+T, c),
    conved (B, T, c) rounded to qkv's dtype as the layer keeps it, in `wide`)."""
    taps, length = weight.shape[-1], qkv.shape[1]
    padded = _padded(qkv, history, wide)
    w = weight[:, 0].to(wide)
    return padded, sum(padded[:, j : j + length] * w[:, j] for j in range(taps)).to(qkv.dtype).to(wide)


def _padded(qkv, history, wide: torch.dtype) -> torch.Tensor:
    """[history; qkv] (B, K-1+T, c) in `wide`, the history rounded to qkv's dtype first (as `_convolve`)."""
    return torch.cat([history.to(qkv.dtype), qkv], 1).to(wide)


def _conv_backward(padded, weight, d_conved):
    """Gradients of <d_conved, conv> to qkv, the weight (c, 1, K) and the history, from
    `_convolved`'s padded input: conved_t = sum_j w_j padded_{t+j}, so
    d padded_s = sum_j w_j d_conved_{s-j} and d w_j = sum_{b, t} padded_{t+j} d_conved_t."""
    taps, length = weight.shape[-1], d_conved.shape[1]
    w = weight[:, 0].to(d_conved.dtype)
    d_padded = sum(F.pad(d_conved * w[:, j], (0, 0, j, taps - 1 - j)) for j in range(taps))
    d_weight = torch.stack([(padded[:, j : j + length] * d_conved).sum((0, 1)) for j in range(taps)], -1)
    return d_padded[:, taps - 1 :], d_weight[:, None].to(weight.dtype), d_padded[:, : taps - 1]


def _token_gates_backward(theta, log_eta, log_keep, d_token_weights, d_decays, momentum: bool):
    """Gradients of the per-token rule's weights and mix (module docstring) to theta, log eta and
    log(1 - alpha), each (B, H, N, C), from d_token_weights (B, H, N, C, 2) and d_decays
    (B, H, N, 2, 2). With tokens 1..C, the chunk start 0, c_w[i] = -2 theta_i g_w[i] (c_w[0] the
    mix's carried entry's gradient), c_m likewise, Q[t, i] = c_w[i] R_t P[t, i]:
    d log eta_j = sum_{t>=j} sum_{i<j} Q[t, i] + sum_{i<j} c_m[i] P[C, i],
    d log(1 - alpha_j) = sum_{t<j} sum_i Q[t, i] + g_00 R_0."""
    chunk = theta.shape[-1]
    position = torch.arange(chunk, device=theta.device)
    lower = position[:, None] >= position[None, :]  # [t, i]: t >= i
    cum_keep = log_keep.cumsum(-1)
    to_end = (cum_keep[..., -1:] - cum_keep).exp()  # R_t, tokens
    if momentum:
        cum_eta = log_eta.cumsum(-1)
        products = (cum_eta[..., :, None] - cum_eta[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        from_start = cum_eta.exp()  # P[t, 0]
    else:
        products = torch.eye(chunk, dtype=theta.dtype, device=theta.device).expand(*theta.shape, chunk)
        from_start = torch.zeros_like(theta)
    d_weight, d_momentum = d_token_weights.unbind(-1)
    weighted = to_end[..., :, None] * products  # [t, i] = R_t P[t, i]
    d_theta = -2 * (d_weight * weighted.sum(-2) + d_momentum * products[..., -1, :])
    d_carried, d_end = d_decays[..., 0, 1], d_decays[..., 1, 1]
    c_weight = -2 * theta * d_weight
    q = c_weight[..., None, :] * weighted  # (..., t, i), tokens
    q_start = d_carried[..., None] * to_end * from_start  # (..., t): the start column
    before = q.cumsum(-1) - q + q_start[..., None]  # [t, j] = sum_{i<j} Q[t, i], the start included
    c_momentum = -2 * theta * d_momentum * products[..., -1, :]
    d_log_eta = (before * lower).sum(-2) + c_momentum.cumsum(-1) - c_momentum \
        + (d_end * from_start[..., -1])[..., None]
    row_sums = q.sum(-1) + q_start
    d_log_keep = row_sums.cumsum(-1) - row_sums + (d_decays[..., 0, 0] * cum_keep[..., -1].exp())[..., None]
    return d_theta, d_log_eta if momentum else torch.zeros_like(d_log_eta), d_log_keep


def _grads_reference(qkv, gate_logits, bias, conv_weight, history, dq, dk, dv, d_token_weights, d_decays, heads: int,
                     chunk: int, max_lr: float, forget_offset: float, qk_norm: bool, value_silu: bool, momentum: bool,
                     forget: bool, gates: str):
    """`_grads_op`'s outputs in plain torch: the module docstring's formulas differentiated up to
    the conv (its own backward is `_conv_backward`)."""
    out = torch.promote_types(qkv.dtype, torch.float32)
    conved = qkv if conv_weight is None else _convolved(qkv, conv_weight, history, out)[1]
    x = conved.to(out).unflatten(-1, (3, heads, -1))  # (B, T, 3, H, d)

    def head_grad(grad, part, norm, silu):
        grad = _unlayout(grad.to(out))
        if norm:
            return _normalized_silu_grad(x[:, :, part], grad)
        return grad * silu_grad(x[:, :, part]) if silu else grad

    d_conved = torch.stack([head_grad(dq, 0, qk_norm, qk_norm), head_grad(dk, 1, qk_norm, qk_norm),
                            head_grad(dv, 2, False, value_silu)], 2).flatten(2)
    logits = gate_logits.to(out) if bias is None else gate_logits.to(out) + bias.to(out)
    theta, eta, alpha = logits.unflatten(-1, (3, heads)).unbind(2)  # (B, T, H) each
    d_token_weights, d_decays = d_token_weights.to(out), d_decays.to(out)
    if gates == "token":
        log_keep = F.logsigmoid(-(alpha + forget_offset)) if forget else torch.zeros_like(alpha)
        gate_values = (max_lr * torch.sigmoid(theta), F.logsigmoid(eta), log_keep)
        d_theta, d_log_eta, d_log_keep = (_unlayout(g) for g in _token_gates_backward(
            *(_layout(g, heads, chunk)[..., 0] for g in gate_values), d_token_weights, d_decays, momentum))
        d_eta = d_log_eta * torch.sigmoid(-eta) if momentum else torch.zeros_like(eta)
        d_alpha = -d_log_keep * torch.sigmoid(alpha + forget_offset) if forget else torch.zeros_like(alpha)
    else:
        d_theta = _unlayout(d_token_weights)[..., 0] * 2
        per_token = _unlayout(d_decays[:, :, :, None].expand(-1, -1, -1, chunk, -1)) / chunk  # (B, T, H, 2)
        d_eta = per_token[..., 0] * _sigmoid_grad(eta) if momentum else torch.zeros_like(eta)
        d_alpha = per_token[..., 1] * _sigmoid_grad(alpha + forget_offset) if forget else torch.zeros_like(alpha)
    return d_conved, torch.cat([d_theta * max_lr * _sigmoid_grad(theta), d_eta, d_alpha], -1)


@torch.library.custom_op("memory_inputs::chunk_inputs_grads", mutates_args=())
def _grads_op(qkv: torch.Tensor, gate_logits: torch.Tensor, bias: torch.Tensor | None,
              conv_weight: torch.Tensor | None, history: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor,
              dv: torch.Tensor, d_token_weights: torch.Tensor, d_decays: torch.Tensor, heads: int, chunk: int,
              max_lr: float, forget_offset: float, qk_norm: bool, value_silu: bool, momentum: bool, forget: bool,
              gates: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the op's outputs (dq ... d_decays, as the outputs) carried back to the convolved
    projections (B, T, 3 H d) (qkv itself without a conv) and to the biased gate logits (B, T, 3 H), fp32
    (float64 for float64 inputs): one Triton launch where `refusal` allows (`chunk_inputs_bwd`), else
    `_grads_reference`."""
    options = (heads, chunk, max_lr, forget_offset, qk_norm, value_silu, momentum, forget, gates)
    if refusal(qkv, gate_logits, heads, chunk, gates, conv_weight, history) is not None:
        return _grads_reference(qkv, gate_logits, bias, conv_weight, history, dq, dk, dv, d_token_weights, d_decays,
                                *options)
    grads = _empty_grads(qkv, gate_logits)
    _launch(_kernels.chunk_inputs_bwd, (*(t.float().contiguous() for t in (dq, dk, dv, d_token_weights, d_decays)),
                                        *grads), qkv, gate_logits, bias, conv_weight, history, *options[:2],
            dq.shape[-1], *options[2:])
    return grads


def _empty_grads(qkv: torch.Tensor, gate_logits: torch.Tensor):
    wide = dict(dtype=torch.promote_types(qkv.dtype, torch.float32), device=qkv.device)
    return torch.empty(qkv.shape, **wide), torch.empty(gate_logits.shape, **wide)


@_grads_op.register_fake
def _(qkv, gate_logits, bias, conv_weight, history, dq, dk, dv, d_token_weights, d_decays, *options):
    return _empty_grads(qkv, gate_logits)


def _backward(ctx, dq, dk, dv, d_token_weights, d_decays):
    """Gradients to qkv, the gate logits, their bias, the conv weight and its history: `_grads_op`
    (one launch on a GPU), then the conv's backward (`_conv_backward`: it reads the next chunk's rows)
    and the bias's sum in torch ops. An unused output's gradient arrives as None and counts as zero."""
    qkv, gate_logits, bias, conv_weight, history = ctx.saved_tensors
    heads, chunk, max_lr, forget_offset, qk_norm, value_silu, momentum, forget, gates = ctx.options
    grads = (dq, dk, dv, d_token_weights, d_decays)
    if any(g is None for g in grads):
        grads = [torch.zeros_like(like) if g is None else g for g, like in
                 zip(grads, _empty_outputs(qkv, heads, chunk, gates))]
    d_qkv, d_logits = _grads_op(qkv, gate_logits, bias, conv_weight, history, *grads, *ctx.options)
    d_conv_weight = d_history = None
    if conv_weight is not None:
        d_qkv, d_conv_weight, d_history = _conv_backward(_padded(qkv, history, d_qkv.dtype), conv_weight, d_qkv)
        d_history = d_history.to(history.dtype)
    d_bias = None if bias is None else d_logits.sum((0, 1)).to(bias.dtype)
    return (d_qkv.to(qkv.dtype), d_logits.to(gate_logits.dtype), d_bias) + (None,) * 9 + (d_conv_weight, d_history)


def _sigmoid_grad(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1 - s)


torch.library.register_autograd("memory_inputs::chunk_inputs", _backward, setup_context=_setup_context)


def chunk_inputs(qkv, gate_logits, bias, heads: int, chunk: int, max_lr: float, forget_offset: float,
                 qk_norm: bool = True, value_silu: bool = False, momentum: bool = True, forget: bool = True,
                 gates: str = "chunk", conv_weight: torch.Tensor | None = None, history: torch.Tensor | None = None):
    """The module docstring's (q, k, v, token weights, decays) through the custom op (one launch
    where `refusal` allows; the torch reference elsewhere). qkv (B, T, 3 H d), gate_logits
    (B, T, 3 H) without `bias` (3 H, or None), `gates` "chunk" or "token", the conv's weight
    (3 H d, 1, K) and history (B, K - 1, 3 H d) or None; ValueError naming the shapes where they
    do not fit."""
    if (problem := _shape_problem(qkv, gate_logits, heads, chunk, gates, conv_weight, history)) is not None:
        raise ValueError(f"chunk_inputs: {problem}")
    return _op(qkv, gate_logits, bias, heads, chunk, float(max_lr), float(forget_offset), qk_norm, value_silu,
               momentum, forget, gates, conv_weight, history)
