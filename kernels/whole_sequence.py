"""The whole-sequence memory path: every chunk of a sequence read and written by one forward
and one backward kernel per layer (kernels/whole_sequence_triton.py), with its plain torch
reference beside it.

The memory is a depth-2 MLP of fast weights per (batch, head), M(x) = silu(x W_1) W_2
(`residual`: x + M(x)), W_1 (d, h), W_2 (h, d), each stacked with its momentum as [M; S]
(B, H, 2, in, out). A sequence is N chunks of C tokens. Chunk c writes the associative
loss's weighted gradient sums G_m = grad_W sum_t tw[t, m] / 2 ||M(k_t) - v_t||^2 taken at the
state entering the chunk (the per-token gradients of Titans' parallel training, arXiv:2501.00663
section 3.2; the factor 2, theta and signs are in the token weights, `chunk_gates` in
models/memory/neural_memory.py) and updates the state by one of two rules:

- the mix rule (Titans' per-token rule unrolled over a chunk, MemoryLlama thesis eq. 2.39-2.40;
  also the chunk rule without Newton-Schulz): [M'; S'] = mix [M; S] + [G_0; G_1], token
  weights (B, H, N, C, 2), gates = mix (B, H, N, 2, 2);
- the Newton-Schulz rule (Mela eq. 10-11; MemoryLlama's Muon update): S' = eta S - G_0,
  M' = (1 - alpha) M + step_scale NS_k(S'), token weights (B, H, N, C, 1), gates (B, H, N, 2)
  = (eta, alpha), NS with Muon's coefficients (kernels/reference.py).

An optional surprise bound (models/memory/chunk_write.py `clip_surprise`, issue 46): with
`limit` (B, H, N, K), each G_m of each weight matrix is scaled before it enters the rule,
G_m <- s G_m, s = limit[c, m] / max(||G_m||_F, limit[c, m]) (the norm over the whole matrix,
separately per batch row, head, matrix and weighting, as the chunk loop's), s a constant in
backward (detached): exactly 1, and everything equal to the unbounded rule, where a sum is
within its limit.

Chunk c's queries read M_{c-1} (the state entering it: thesis eq. 2.41), or with
`read_after_write` its own M_c (Mela's HMM). Returns y (B, H, N, C, d) and the final state.

`whole_sequence_reference` is the rule in plain torch, the per-token gradients by autograd
(`torch.func.grad`), differentiated by autograd. `whole_sequence_memory` runs the Triton
kernels through two custom ops (`memory_kernels::whole_sequence_fwd` / `_bwd`), which
torch.compile keeps opaque (the chunk loop is never traced, whatever T) and which have meta
implementations (the launch count and shapes can be checked on the meta device). The forward
keeps the state entering every `checkpoint_every`-th chunk (and the final state) for the
backward (`saved_bytes`); the backward recomputes the states between and each chunk's
intermediates from them, so nothing per token is kept besides the inputs.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.nn.functional as F

from kernels.ptxas import (HOPPER, arch_of, tensor_core_mode, tensor_core_products, triton_ptxas, version_of,
                           warn_fma_fallback)
from kernels.reference import MUON_COEFFICIENTS, newton_schulz_reference

try:
    import triton

    from kernels import whole_sequence_triton as _kernels
except ImportError:  # the torch reference needs no triton (a Hugging Face export ships without it)
    triton = _kernels = None

HIDDEN_BLOCK = 16  # the kernels walk the hidden width in blocks of this many columns (16: no spills, `_blocks`)
MAX_TILE = 128  # head_dim and chunk: whole tiles of one program (padded to a power of two)
FP32, TENSOR_CORES, FMA_BF16 = 0, 1, 2  # the kernels' BF16 switch (whole_sequence_triton._dot_add)


# ---------------------------------------------------------------------------------------------
# torch reference


def _mlp(weights, x, residual):
    w1, w2 = weights
    out = F.silu(x @ w1) @ w2
    return out + x if residual else out


def _write_gradients(weights, k, v, token_weights, residual):
    """G_m = grad_W sum_t token_weights[t, m] / 2 ||M(k_t) - v_t||^2 for each weighting m,
    by autograd: a tuple per m of (dW_1, dW_2), each (B, H, in, out)."""
    def loss(w, m):
        error = _mlp(w, k, residual) - v
        return 0.5 * (token_weights[..., m, None] * error.square()).sum()

    return [torch.func.grad(loss)(tuple(weights), m) for m in range(token_weights.shape[-1])]


def _clip(grads, limit):
    """The surprise bound (module docstring): each G_m of each matrix (grads: per m a tuple of
    (B, H, in, out)) times s = limit_m / max(||G_m||_F, limit_m), limit (B, H, K), s detached."""
    scales = [[(limit[..., m] / g.flatten(-2).norm(dim=-1).clamp_min(limit[..., m])).detach() for g in pair]
              for m, pair in enumerate(grads)]
    return [tuple(g * s[..., None, None] for g, s in zip(pair, sc)) for pair, sc in zip(grads, scales)]


def whole_sequence_reference(state, q, k, v, token_weights, gates, ns_steps: int = 0, step_scale: float = 1.0,
                             residual: bool = False, read_after_write: bool = False, limit=None):
    """The module docstring's rule in plain torch, chunk by chunk; arithmetic in the state's
    dtype. limit (B, H, N, K) or None: the surprise bound of each chunk's G_m (module docstring)."""
    dtype = state[0].dtype
    q, k, v, token_weights, gates = (t.to(dtype) for t in (q, k, v, token_weights, gates))
    ys = []
    for c in range(q.shape[2]):
        weights = [s[:, :, 0] for s in state]
        grads = _write_gradients(weights, k[:, :, c], v[:, :, c], token_weights[:, :, c], residual)
        if limit is not None:
            grads = _clip(grads, limit[:, :, c].to(dtype))
        if ns_steps:
            eta, alpha = gates[:, :, c, 0, None, None], gates[:, :, c, 1, None, None]
            new = []
            for s, g in zip(state, grads[0]):
                momentum = eta * s[:, :, 1] - g
                step = newton_schulz_reference(momentum, ns_steps, MUON_COEFFICIENTS)
                new.append(torch.stack([(1 - alpha) * s[:, :, 0] + step_scale * step, momentum], 2))
        else:
            mix = gates[:, :, c]
            new = [torch.einsum("bhij,bhjxy->bhixy", mix, s) + torch.stack([g0, g1], 2)
                   for s, g0, g1 in zip(state, grads[0], grads[1])]
        read = new if read_after_write else state
        ys.append(_mlp([s[:, :, 0] for s in read], q[:, :, c], residual))
        state = tuple(new)
    return torch.stack(ys, 2), state


# ---------------------------------------------------------------------------------------------
# Triton, through custom ops


def refusal(state, q, k, v, token_weights, gates, ns_steps: int) -> str | None:
    """Why the Triton path cannot take this call (None when it can)."""
    if _kernels is None:
        return "triton is not installed"
    device = q.device.type
    if device not in ("cuda", "meta") and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the inputs are on {q.device}: the kernels need a CUDA device (or TRITON_INTERPRET=1)"
    if len(state) != 2:
        return f"depth {len(state)}: the whole-sequence kernels take depth 2"
    if any(s.dtype != torch.float32 for s in state):
        return f"state dtype {state[0].dtype}: the kernels keep a float32 state"
    if any(t.dtype not in (torch.float32, torch.bfloat16) for t in (q, k, v, token_weights, gates)):
        return "q, k, v, token weights and gates must be float32 or bfloat16"
    batch, heads, chunks, chunk, dim = q.shape
    hidden = state[0].shape[-1]
    if max(dim, chunk) > MAX_TILE:
        return f"head_dim {dim}, chunk {chunk}: the kernels take each up to {MAX_TILE}"
    expected = [(batch, heads, 2, dim, hidden), (batch, heads, 2, hidden, dim)]
    if [tuple(s.shape) for s in state] != expected:
        return f"state shapes {[tuple(s.shape) for s in state]}; expected {expected}"
    weightings = 1 if ns_steps else 2
    gate_shape = (batch, heads, chunks, 2) if ns_steps else (batch, heads, chunks, 2, 2)
    for name, t, shape in (("k", k, q.shape), ("v", v, q.shape),
                           ("token_weights", token_weights, (batch, heads, chunks, chunk, weightings)),
                           ("gates", gates, gate_shape)):
        if tuple(t.shape) != tuple(shape):
            return f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}"
    return None


# Overrides of the hidden block and the warps per program, for a lease to time other choices without
# a code change (docs/benchmarks.md, "Fifth lease": wider blocks issue wider wgmmas and spill more)
HIDDEN_BLOCK_ENV, WARPS_ENV = "WHOLE_SEQUENCE_HIDDEN_BLOCK", "WHOLE_SEQUENCE_WARPS"


def _override(name: str, allowed: tuple[int, ...]) -> int | None:
    """The integer in environment variable `name` (one of `allowed`), None where unset; ValueError
    naming the choices for anything else."""
    text = os.environ.get(name)
    if not text:
        return None
    if not text.isdigit() or int(text) not in allowed:
        raise ValueError(f"{name}={text!r}: choose one of {', '.join(map(str, allowed))} (or leave it unset)")
    return int(text)


def _blocks(dim: int, chunk: int, hidden: int) -> dict:
    """The launch's tile sizes (powers of two, >= 16) and warps: the hidden width in blocks of
    `HIDDEN_BLOCK` columns (or `HIDDEN_BLOCK_ENV`'s), 8 warps for a chunk x head_dim tile over
    64 x 32, else 4 (or `WARPS_ENV`'s)."""
    pad = triton.next_power_of_2 if triton else (lambda n: 1 << (n - 1).bit_length())
    block = _override(HIDDEN_BLOCK_ENV, (16, 32, 64, 128)) or HIDDEN_BLOCK
    warps = _override(WARPS_ENV, (4, 8, 16)) or (8 if dim * chunk > 64 * 32 else 4)
    return {"BC": max(16, pad(chunk)), "BD": max(16, pad(dim)), "BH": max(16, min(block, pad(hidden))),
            "num_warps": warps}


def _checkpoints(q: torch.Tensor, hidden: int, chunks: int, every: int):
    """Empty (B*H, ceil(chunks / every) + 1, 2, d, h) and (..., h, d) fp32 checkpoint buffers."""
    batch, heads, _, _, dim = q.shape
    entries = -(-chunks // every) + 1
    return (q.new_empty(batch * heads, entries, 2, dim, hidden, dtype=torch.float32),
            q.new_empty(batch * heads, entries, 2, hidden, dim, dtype=torch.float32))


def _group_buffers(q: torch.Tensor, hidden: int, every: int):
    """The states inside a group of `every` chunks, (B*H, every, 2, d, h) and (..., h, d) fp32
    (one entry's worth where every = 1: the kernels compute its address but never use it)."""
    batch, heads, _, _, dim = q.shape
    return (q.new_empty(batch * heads, every, 2, dim, hidden, dtype=torch.float32),
            q.new_empty(batch * heads, every, 2, hidden, dim, dtype=torch.float32))


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(B, H, ...) -> (B*H, ...) fp32, contiguous: the kernels read fp32 inputs only (the layer
    casts q, k, v before the op, where torch.compile fuses the cast into their producer)."""
    return t.to(torch.float32).contiguous().flatten(0, 1)


def products(bf16_products: bool, device: torch.device) -> int:
    """The kernels' BF16 switch: FP32 without bf16 products; with them TENSOR_CORES or FMA_BF16
    (bf16-rounded operands on the FMA units: the same values as bf16 products), as
    WHOLE_SEQUENCE_TENSOR_CORES says (kernels/ptxas.py): "auto" (the default) the tensor cores on a
    Hopper GPU whose Triton ptxas is safe for wgmma (an unsafe one is warned once and runs
    FMA_BF16), FMA_BF16 elsewhere; "wgmma" the same gate on any GPU; "mma" always; "fma" never.
    Under TRITON_INTERPRET=1 always FMA_BF16: the interpreter's bf16 dot is wrong (Triton 3.9:
    error 2e10 on a 16 x 16 product)."""
    if not bf16_products:
        return FP32
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return FMA_BF16
    mode = tensor_core_mode()
    if mode == "fma":
        return FMA_BF16
    if mode == "mma":
        return TENSOR_CORES
    arch = arch_of(device)
    if mode == "auto" and arch != HOPPER:
        return FMA_BF16
    if tensor_core_products(arch, version_of(triton_ptxas(arch) or "")):
        return TENSOR_CORES
    warn_fma_fallback(arch)
    return FMA_BF16


@contextlib.contextmanager
def without_wgmma():
    """DISABLE_MMA_V3=1 inside (Triton then lowers tl.dot to the synchronous mma.sync, MMAv2,
    instead of Hopper's wgmma), its former value restored after."""
    before = os.environ.get("DISABLE_MMA_V3")
    os.environ["DISABLE_MMA_V3"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["DISABLE_MMA_V3"]
        else:
            os.environ["DISABLE_MMA_V3"] = before


def mma_family(switch: int):
    """Around a launch (where Triton compiles): `without_wgmma` for tensor-core products in the
    "mma" mode, else nothing. Triton's disk cache keys on DISABLE_MMA_V3; its in-process cache
    of a kernel does not, which holds because a process runs these kernels in one mode (the
    environment's, read here at each launch)."""
    return without_wgmma() if switch == TENSOR_CORES and tensor_core_mode() == "mma" else contextlib.nullcontext()


def _launch_options(q, s1, ns_steps, bf16_products, limit):
    a, b, c = MUON_COEFFICIENTS
    return dict(K=1 if ns_steps else 2, NS_STEPS=ns_steps, A_COEF=a, B_COEF=b, C_COEF=c,
                BF16=products(bf16_products, q.device), LIMITED=limit is not None, num_stages=1,
                **_blocks(q.shape[-1], q.shape[-2], s1.shape[-1]))


def _scales(q: torch.Tensor, limit: torch.Tensor | None) -> torch.Tensor:
    """The surprise bound's scales (B*H, N, 2, 2) fp32 = [matrix][weighting] of every chunk (an
    empty (0,) tensor without a bound)."""
    batch, heads, chunks = q.shape[:3]
    return q.new_empty((batch * heads, chunks, 2, 2) if limit is not None else (0,), dtype=torch.float32)


def _limit_pointer(limit: torch.Tensor | None, scales: torch.Tensor) -> torch.Tensor:
    """The limits (B*H, N, K) as the kernels read them (without a bound any tensor: never read)."""
    return scales if limit is None else _flat(limit.to(torch.float32))


@torch.library.custom_op("memory_kernels::whole_sequence_fwd", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_weights: torch.Tensor, gates: torch.Tensor,
                s1: torch.Tensor, s2: torch.Tensor, ns_steps: int, step_scale: float, residual: bool,
                read_after_write: bool, checkpoint_every: int, bf16_products: bool, limit: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y (B, H, N, C, d), final s1, final s2, ck1 (B*H, NG + 1, 2, d, h), ck2 (B*H, NG + 1, 2, h, d),
    the bound's scales (`_scales`)), NG = ceil(N / checkpoint_every), all fp32: one launch and no copy
    (the kernel reads the initial state where it is, fp32 and contiguous as the layer's states are, and
    writes the final state to its output; checkpoints 0 and NG are left unused); limit (B, H, N, K) or None."""
    batch, heads, chunks, chunk, dim = q.shape
    hidden = s1.shape[-1]
    ck1, ck2 = _checkpoints(q, hidden, chunks, checkpoint_every)
    final1, final2 = (s.new_empty(s.shape, dtype=torch.float32) for s in (s1, s2))
    y = q.new_empty(q.shape, dtype=torch.float32)
    scratch = q.new_empty(batch * heads, 2, dim, hidden, dtype=torch.float32) if ns_steps else y
    scales = _scales(q, limit)
    options = _launch_options(q, s1, ns_steps, bf16_products, limit)
    with mma_family(options["BF16"]):
        _kernels.whole_sequence_fwd[(batch * heads,)](
            _flat(q), _flat(k), _flat(v), _flat(token_weights), _flat(gates), _limit_pointer(limit, scales), scales,
            ck1, ck2, *_group_buffers(q, hidden, checkpoint_every), _flat(s1), _flat(s2), final1, final2, y, scratch,
            float(step_scale), chunks, checkpoint_every, chunk, dim, hidden, RESIDUAL=residual,
            READ_AFTER_WRITE=read_after_write, **options)
    return y, final1, final2, ck1, ck2, scales


@_forward_op.register_fake
def _(q, k, v, token_weights, gates, s1, s2, ns_steps, step_scale, residual, read_after_write, checkpoint_every,
      bf16_products, limit=None):
    return (q.new_empty(q.shape, dtype=torch.float32), s1.new_empty(s1.shape, dtype=torch.float32),
            s2.new_empty(s2.shape, dtype=torch.float32), *_checkpoints(q, s1.shape[-1], q.shape[2], checkpoint_every),
            _scales(q, limit))


@torch.library.custom_op("memory_kernels::whole_sequence_bwd", mutates_args=())
def _backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_weights: torch.Tensor, gates: torch.Tensor,
                 ck1: torch.Tensor, ck2: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, final1: torch.Tensor,
                 final2: torch.Tensor, dy: torch.Tensor, dn1: torch.Tensor, dn2: torch.Tensor,
                 ns_steps: int, step_scale: float, residual: bool, read_after_write: bool, checkpoint_every: int,
                 bf16_products: bool, limit: torch.Tensor | None = None, scales: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor]:
    """(dq, dk, dv, d token_weights, d gates, d s1, d s2), all fp32: one launch and no copy for fp32
    contiguous inputs (the kernel copies dn into the gradients it updates in place, and its
    recomputation writes its scales to a buffer of its own); s1, s2 the forward's initial and final1,
    final2 its final state; limit and the forward's scales (`_scales`) with a bound (constants here)."""
    batch, heads, chunks, chunk, dim = q.shape
    hidden = ck1.shape[-1]
    ds1, ds2 = (q.new_empty(d.shape, dtype=torch.float32).flatten(0, 1) for d in (dn1, dn2))
    dq, dk, dv = (q.new_empty(q.shape, dtype=torch.float32) for _ in range(3))
    dtw = q.new_empty(token_weights.shape, dtype=torch.float32)
    dgates = q.new_empty(gates.shape, dtype=torch.float32)
    iterates = q.new_empty(batch * heads, 2, max(ns_steps, 1), dim, hidden, dtype=torch.float32)
    ybuf = q.new_empty(batch * heads, 2, dim, hidden, dtype=torch.float32)
    scales = _scales(q, limit) if scales is None else scales
    options = _launch_options(q, ck1, ns_steps, bf16_products, limit)
    with mma_family(options["BF16"]):
        _kernels.whole_sequence_bwd[(batch * heads,)](
            _flat(q), _flat(k), _flat(v), _flat(token_weights), _flat(gates), _limit_pointer(limit, scales), scales,
            torch.empty_like(scales), ck1, ck2, *_group_buffers(q, hidden, checkpoint_every), _flat(s1), _flat(s2),
            _flat(final1), _flat(final2), _flat(dy), _flat(dn1), _flat(dn2), ds1, ds2, dq, dk, dv,
            dtw, dgates, iterates, ybuf, float(step_scale), chunks, checkpoint_every, chunk, dim, hidden,
            RESIDUAL=residual, READ_AFTER_WRITE=read_after_write, **options)
    return dq, dk, dv, dtw, dgates, ds1.view(dn1.shape), ds2.view(dn2.shape)


@_backward_op.register_fake
def _(q, k, v, token_weights, gates, ck1, ck2, s1, s2, final1, final2, dy, dn1, dn2, ns_steps, step_scale, residual,
      read_after_write, checkpoint_every, bf16_products, limit=None, scales=None):
    fp32 = dict(dtype=torch.float32)
    return (q.new_empty(q.shape, **fp32), q.new_empty(q.shape, **fp32), q.new_empty(q.shape, **fp32),
            q.new_empty(token_weights.shape, **fp32), q.new_empty(gates.shape, **fp32),
            q.new_empty(dn1.shape, **fp32), q.new_empty(dn2.shape, **fp32))


def _setup_context(ctx, inputs, output):
    q, k, v, token_weights, gates, s1, s2, *options, limit = inputs
    _, final1, final2, ck1, ck2, scales = output
    ctx.save_for_backward(q, k, v, token_weights, gates, ck1, ck2, s1, s2, final1, final2, limit, scales)
    ctx.mark_non_differentiable(ck1, ck2, scales)
    ctx.set_materialize_grads(False)
    ctx.options = options
    ctx.state_shapes = (s1.shape, s2.shape)


def _backward(ctx, dy, dn1, dn2, _dck1, _dck2, _dscales):
    """Gradients of (y, final state) back to the inputs and the initial state (none to the
    bound's limits: its scales are constants); an output nothing used arrives as None and
    counts as zero."""
    q, k, v, token_weights, gates, ck1, ck2, s1, s2, final1, final2, limit, scales = ctx.saved_tensors
    dy = q.new_zeros(q.shape, dtype=torch.float32) if dy is None else dy
    dn1, dn2 = (q.new_zeros(shape, dtype=torch.float32) if d is None else d
                for d, shape in zip((dn1, dn2), ctx.state_shapes))
    dq, dk, dv, dtw, dgates, ds1, ds2 = _backward_op(q, k, v, token_weights, gates, ck1, ck2, s1, s2, final1, final2,
                                                     dy, dn1, dn2,
                                                     *ctx.options, limit, None if limit is None else scales)
    cast = [g.to(t.dtype) for g, t in zip((dq, dk, dv, dtw, dgates), (q, k, v, token_weights, gates))]
    return (*cast, ds1, ds2, None, None, None, None, None, None, None)


torch.library.register_autograd("memory_kernels::whole_sequence_fwd", _backward, setup_context=_setup_context)


def whole_sequence_memory(state, q, k, v, token_weights, gates, ns_steps: int = 0, step_scale: float = 1.0,
                          residual: bool = False, read_after_write: bool = False, checkpoint_every: int = 1,
                          bf16_products: bool = False, limit: torch.Tensor | None = None, return_scales: bool = False):
    """The Triton path of the module docstring's rule: (y (B, H, N, C, d) fp32, final state
    (two (B, H, 2, in, out) fp32)), and with `return_scales` the bound's scales (B*H, N, 2, K)
    fp32 = [matrix][weighting] of every chunk (1 where it did not clip; (0,) without a bound); the state entering every `checkpoint_every`-th chunk is kept
    for the backward; `bf16_products`: the fast-weight products from bf16 operands (the values
    bf16 autocast gives the chunk loop's; on the tensor cores where `products` allows), else
    fp32 exactly; `limit` (B, H, N, K) the surprise bound
    of each chunk's G_m (module docstring; models/memory/chunk_write.py `surprise_limit`), None
    unbounded. ValueError naming the reason where it cannot run (`refusal`)."""
    reason = refusal(state, q, k, v, token_weights, gates, ns_steps)
    if reason is None and checkpoint_every < 1:
        reason = f"checkpoint_every {checkpoint_every} (must be >= 1)"
    if reason is None and limit is not None and tuple(limit.shape) != (*q.shape[:3], token_weights.shape[-1]):
        reason = f"limit has shape {tuple(limit.shape)}; expected {(*q.shape[:3], token_weights.shape[-1])}"
    if reason is not None:
        raise ValueError(f"whole_sequence_memory: {reason}; use the chunked path")
    flat_gates = gates if ns_steps else gates.flatten(-2)
    y, s1, s2, _, _, scales = _forward_op(q, k, v, token_weights, flat_gates, state[0], state[1], ns_steps,
                                          float(step_scale), residual, read_after_write, checkpoint_every,
                                          bf16_products, None if limit is None else limit.detach())
    if return_scales:
        return y, (s1, s2), scales[..., : token_weights.shape[-1]] if limit is not None else scales
    return y, (s1, s2)


def saved_bytes(batch: int, heads: int, seq_len: int, chunk: int, head_dim: int, hidden: int,
                input_bytes: int = 2, checkpoint_every: int = 1) -> int:
    """Bytes the whole-sequence path keeps from forward to backward for one layer: the fp32
    state entering every `checkpoint_every`-th chunk and the final state ([M; S] of W_1 and W_2)
    plus q, k, v (`input_bytes` each element), two token weightings and four gates per chunk in fp32."""
    chunks = math.ceil(seq_len / chunk)
    state = (math.ceil(chunks / checkpoint_every) + 1) * 2 * 2 * head_dim * hidden * 4
    inputs = 3 * seq_len * head_dim * input_bytes + seq_len * 2 * 4 + chunks * 4 * 4
    return batch * heads * (state + inputs)


def kernel_cost(batch: int, heads: int, chunks: int, chunk: int, dim: int, hidden: int, ns_steps: int,
                checkpoint_every: int, backward: bool) -> tuple[float, float]:
    """(FLOPs, bytes) of one launch of the forward (or backward) kernel, counted from the
    kernels' matmuls (u = chunk x dim x hidden; one (C, d) x (d, h) product is 2u FLOPs; K token
    weightings, 2 for the mix rule, 1 for Newton-Schulz):
    forward per chunk (12 + 4K) u (the key error, the read, the write's gradient sums) plus
    2 ns (4 d^2 h + 2 d^3) (Newton-Schulz on both matrices); backward per chunk (34 + 10K) u plus
    2 ((ns - 1) (4 d^2 h + 2 d^3) + ns (8 d^2 h + 6 d^3)) (the iterates recomputed, then
    differentiated) plus the recomputed forward of the (G - 1) / G chunks between checkpoints.
    Bytes (an approximation): per chunk the forward reads the state 1.5 times and writes it
    once (40 d h, fp32), reads q, k, v and writes y (16 C d), and moves 24 d h per
    Newton-Schulz step; the backward three times the forward's."""
    u = chunk * dim * hidden
    weightings = 1 if ns_steps else 2
    newton_schulz = 2 * ns_steps * (4 * dim * dim * hidden + 2 * dim ** 3)
    forward = (12 + 4 * weightings) * u + newton_schulz
    forward_bytes = 40 * dim * hidden + 16 * chunk * dim + ns_steps * 24 * dim * hidden
    if backward:
        ns_backward = 2 * (max(ns_steps - 1, 0) * (4 * dim * dim * hidden + 2 * dim ** 3)
                           + ns_steps * (8 * dim * dim * hidden + 6 * dim ** 3))
        recompute = (forward - 4 * u) * (checkpoint_every - 1) / checkpoint_every
        flops, nbytes = (34 + 10 * weightings) * u + ns_backward + recompute, 3 * forward_bytes
    else:
        flops, nbytes = forward, forward_bytes
    programs = batch * heads * chunks
    return float(programs * flops), float(programs * nbytes)