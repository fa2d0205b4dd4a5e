"""The chunk loop of the neural memory (`NeuralMemory`, models/memory/neural_memory.py, whose
module docstring states the rule): its state (`MemoryState`), how each chunk is written and
read (`UpdateRule`), one chunk's step (`chunk_step`, compiled: `compiled_chunk_step`), the
loop over a call's chunks (`run_chunks`), all chunks through the whole-sequence kernels
(`whole_sequence_chunks`) and a stream's read and write (`chunked_memory`)."""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kernels import bounded_compile
from kernels import memory_update as kernel_memory_update
from kernels import (FUSED_TOKEN_STEP_BACKENDS, token_chunk_step, token_step_backend,
                     token_step_refusal)
from kernels.token_step import AUTOCAST_DEVICE_TYPES
from kernels.whole_sequence import refusal as whole_sequence_refusal
from kernels.whole_sequence import whole_sequence_memory
from models.memory.chunk_write import (associative_grads, chunk_gates, clip_surprise, mlp_forward, surprise_limit,
                                       token_scan_update)


class MemoryState(NamedTuple):
    """weights, momentum: tuples of (B, H, in, out) in the state dtype; `pending` holds the
    (k, v, theta, log_eta, log_keep) of a not-yet-complete chunk: (B, H, n, d) / (B, H, n),
    log_keep = log(1 - alpha); `conv` (B, conv_kernel - 1, 3 * H * d) the last q/k/v
    projections before the conv (empty when there is no conv); `stacked`: the [M; S] per weight
    matrix (B, H, 2, in, out) whose views weights and momentum are (`stacked_state`), which the
    next write takes as it is (no stack copied at each call), or None (then the write stacks
    weights and momentum itself). A state whose weights or momenta are replaced must drop it
    (the constructor without it) or rebuild it (`stacked_state`).

    Code that torch.compile traces builds a new state with the constructor, never `_replace`:
    a state made by `_replace` inside a graph torch 2.11 compiled came back to Python malformed
    (its fields raised IndexError when the next compiled call read them; Mela on an H200,
    2026-11-28; reproduced on CPU under torch 2.11)."""

    weights: tuple[torch.Tensor, ...]
    momentum: tuple[torch.Tensor, ...]
    pending: tuple[torch.Tensor, ...]
    conv: torch.Tensor
    stacked: tuple[torch.Tensor, ...] | None = None

    def detach(self) -> "MemoryState":
        if self.stacked is not None:
            return stacked_state(tuple(s.detach() for s in self.stacked), tuple(t.detach() for t in self.pending),
                                 self.conv.detach())
        return MemoryState(*(tuple(t.detach() for t in part) for part in self[:3]), self.conv.detach())


def stacked_state(stacked: tuple, pending: tuple, conv: torch.Tensor) -> MemoryState:
    """The state whose weights and momenta are the views of `stacked` ((B, H, 2, in, out) per matrix)."""
    weights, momentum = _unstacked(stacked)
    return MemoryState(weights, momentum, pending, conv, stacked)


class UpdateRule(NamedTuple):
    """How each chunk is written and read (the config's fields of the same names).
    `backend`: gates="chunk", `kernels.memory_update`'s backend; gates="token", the fused chunk
    step of kernels/token_step.py (`kernels.token_chunk_step`, Triton kernels or the torch
    reference with a hand-written backward) when it resolves to "triton" or "fused_torch" (asked for
    explicitly: "auto" resolves to them only by an auto-table entry, and none exists), the
    step below otherwise. A step the fused path does not take (read_after_write,
    max_update_norm > 0, depth > 2, the kernels' size / dtype / device limits; "triton" inside
    torch.compile) falls back to the step below with a warning. gates="chunk" takes no
    "fused_torch" (`kernels.memory_update` refuses it)."""

    gates: str = "token"
    ns_steps: int = 0
    backend: str = "auto"
    read_after_write: bool = False
    step_scale: float = 1.0
    residual: bool = False
    max_update_norm: float = 0.0
    whole_sequence: bool = False


def chunk_step(state, q_c, k_c, v_c, token_weights_c, decays_c, rule: UpdateRule, limit_c: torch.Tensor | None = None):
    """One chunk: its tokens read the state left by the previous chunk (or, with
    `rule.read_after_write`, the state after this chunk's write), and the chunk is written.
    state: per weight matrix (B, H, 2, in, out), the fast weights and their momentum stacked
    ([:, :, 0] and [:, :, 1]); q_c, k_c, v_c (B, H, C, d); token_weights_c (B, H, C, K),
    decays_c (B, H, 2, 2) or (B, H, 2): the chunk's slice of `chunk_gates`; limit_c (B, H, K)
    the chunk's `surprise_limit` under `rule.max_update_norm` (computed here when None). Reading
    before the write, queries and keys go through M together (one matmul per layer). Returns
    (y_c, new state, the surprise sums' clip scales (`clip_surprise`; None without a bound))."""
    fused = rule.backend if rule.gates == "token" else None  # "auto" resolved once per call (`chunked_memory`)
    if fused in FUSED_TOKEN_STEP_BACKENDS:  # kernels/token_step.py (UpdateRule)
        refusal = "read_after_write" if rule.read_after_write else \
            "max_update_norm > 0 (the fused step has no surprise bound: set it to 0 to take it)" \
            if rule.max_update_norm else \
            token_step_refusal(fused, state, q_c, k_c, v_c, token_weights_c, decays_c)
        if refusal is None:
            return (*token_chunk_step(state, q_c, k_c, v_c, token_weights_c, decays_c, rule.residual, fused), None)
        if not torch.compiler.is_compiling():
            warnings.warn(f"fused per-token chunk step ({fused}) not taken, unfused step instead: {refusal}", stacklevel=2)
    size = q_c.shape[2]
    weights = [s[:, :, 0] for s in state]
    if rule.read_after_write:
        out_k, saved = mlp_forward(weights, k_c, rule.residual)
    else:
        both, saved_both = mlp_forward(weights, torch.cat([q_c, k_c], 2), rule.residual)
        saved = [(k_c if i == 0 else inp[:, :, size:], pre[:, :, size:]) for i, (inp, pre) in enumerate(saved_both)]
        y_c, out_k = both.unflatten(2, (2, size)).unbind(2)
    grads, scales = associative_grads(weights, saved, out_k, v_c, token_weights_c), None
    if rule.max_update_norm:
        limit = surprise_limit(token_weights_c, rule.max_update_norm) if limit_c is None else limit_c
        grads, scales = clip_surprise(grads, limit)
    if rule.gates == "token":
        state = token_scan_update(state, grads, decays_c)
    else:
        eta, alpha = decays_c.unbind(-1)
        state = tuple(torch.stack(kernel_memory_update(s[:, :, 0], s[:, :, 1], g[:, :, 0], eta, alpha, rule.ns_steps,
                                                       rule.backend, rule.step_scale), 2)
                      for s, g in zip(state, grads))
    if rule.read_after_write:
        y_c = mlp_forward([s[:, :, 0] for s in state], q_c, rule.residual)[0]
    return y_c, state, scales


@functools.cache
def compiled_chunk_step():
    """`chunk_step` through `kernels.bounded_compile` (fused elementwise work): static
    shapes, fullgraph, up to `kernels.COMPILED_GRAPH_LIMIT` (64) graphs per process, then
    new shapes run eagerly after one warning. Each new (batch, heads, chunk, head_dim,
    depth, expansion, dtype, write rule) compiles one graph, two where the first chunk's
    state does not require grad and the later chunks' does (fixed initial weights,
    `learned_init=False`). torch's shared limit of 8 made the fifth shape fail hard (issue 29).

    Chosen over a dynamic batch dimension: shapes also change by heads, chunk, widths,
    depth and dtype, which a dynamic batch does not cover, so a bound with an eager fallback
    is needed anyway, and static graphs keep today's kernels. Costs, measured on torch 2.13
    CPU (2 cores shared, load 7-13, so walls are inflated): a new shape costs two compiles,
    15.7 s + 2.1 s of dynamo + Inductor time for the first shape of a tiny layer (dim 16,
    2 heads of 8, chunk 4; the first includes the process's one-time warm-up), 33.9 s of
    in-process CPU for the first shape at the benchmark's widths (B 4, T 1024, chunk 16;
    g++ time not counted); the step runs the same graphs as before plus the wrapper's
    checks, 1.5 us per chunk (0.2 ms per forward of 128 chunks). The dynamic-batch
    alternative was not measured (the machine was too loaded to finish its compiles).
    """
    return bounded_compile(chunk_step)


def run_chunks(step, state, q, k, v, theta, log_eta, log_keep, rule: UpdateRule):
    """Apply `step` to G chunks in order, from the stacked state of `chunk_step`: q, k, v
    (B, H, G, C, d), theta, log_eta, log_keep (B, H, G, C). Their gates' share of each write
    (`chunk_gates`) is computed first for all G chunks at once (inside a `checkpoint_chunks`
    group, so recomputed with it rather than kept). Per-chunk views come from unbind: slicing
    chunk by chunk would make autograd scatter every chunk's gradient into a zero tensor of
    all the chunks' size (quadratic in T). With a surprise bound, the limits of all G chunks'
    sums (`surprise_limit`) are computed at once too, and the sums clipped are counted once
    after the loop. Returns (the chunks' reads, final stacked state, surprise sums clipped
    (0-dim): 0 without a bound, no tensor op added)."""
    outputs, scales = [], []
    token_weights, decays = chunk_gates(theta, log_eta, log_keep, rule.gates)
    limits = surprise_limit(token_weights, rule.max_update_norm).unbind(2) if rule.max_update_norm else \
        (None,) * q.shape[2]
    for *chunk_inputs, limit_c in zip(*(t.unbind(2) for t in (q, k, v, token_weights, decays)), limits):
        y_c, state, scales_c = step(state, *chunk_inputs, rule, limit_c)
        outputs.append(y_c)
        if scales_c is not None:
            scales.append(scales_c)
    return outputs, state, (torch.stack(scales) < 1).sum() if scales else 0


def sequence_gates(token_weights, decays, rule: UpdateRule):
    """`chunk_gates`' output (all N chunks) in the form of kernels/whole_sequence.py: the
    token rule's as it is; the chunk rule with Newton-Schulz as (eta, alpha) per chunk; the
    chunk rule without it as the mix rule, M' = (1 - alpha) M + s (eta S - G), S' = eta S - G:
    mix [[1 - alpha, s eta], [0, eta]], token weights (-s 2 theta, -2 theta)."""
    if rule.gates == "token" or rule.ns_steps:
        return token_weights, decays
    eta, alpha = decays.unbind(-1)
    mix = torch.stack([1 - alpha, rule.step_scale * eta, torch.zeros_like(eta), eta], -1).unflatten(-1, (2, 2))
    return torch.cat([-rule.step_scale * token_weights, -token_weights], -1), mix


def whole_sequence_chunks(stacked, q, k, v, token_weights, decays, rule: UpdateRule, checkpoint_every: int = 1):
    """All chunks (q, k, v (B, H, N, C, d); `chunk_gates`' token weights and decays) through
    `kernels.whole_sequence_memory` (one forward and one backward launch, the state of every
    `checkpoint_every`-th chunk kept; with `rule.max_update_norm` the kernels clip each chunk's
    sums to `surprise_limit` of its token weights, as `chunk_step` does), or None with a warning
    naming why it cannot (then the caller runs the chunk loop). Returns (reads (B, H, N, C, d),
    final stacked state, surprise sums clipped (0-dim; 0 without a bound))."""
    token_weights, gates = sequence_gates(token_weights, decays, rule)
    reason = whole_sequence_refusal(stacked, q, k, v, token_weights, gates, rule.ns_steps)
    if reason is not None:
        if not torch.compiler.is_compiling():
            warnings.warn(f"whole-sequence memory path not taken, chunk loop instead: {reason}", stacklevel=3)
        return None
    device = q.device.type
    bf16 = device in AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device) and \
        torch.get_autocast_dtype(device) == torch.bfloat16  # the chunk loop's matmuls would be bf16 too
    limit = surprise_limit(token_weights, rule.max_update_norm) if rule.max_update_norm else None
    # fp32 here, where torch.compile fuses the cast into the op producing q/k/v: the kernels read fp32 only
    # (kernels/whole_sequence.py `_flat`), and a cast inside the opaque custom op would be a launch of its own
    y, state, scales = whole_sequence_memory(stacked, *(t.float() for t in (q, k, v)), token_weights, gates,
                                             rule.ns_steps, rule.step_scale,
                                             rule.residual, rule.read_after_write, checkpoint_every, bf16, limit,
                                             return_scales=True)
    if limit is not None and rule.gates != "token":  # the mix form's two sums are one (s G, G): count G once
        scales = scales[..., -1:]
    clipped = (scales < 1).sum() if limit is not None else 0
    return y.to(q.dtype), tuple(s.to(t.dtype) for s, t in zip(state, stacked)), clipped


def state_stacks(state: MemoryState) -> tuple:
    """The state's [M; S] per weight matrix, (B, H, 2, in, out): the state's own `stacked` where
    it holds them, else stacked here."""
    if state.stacked is not None:
        return state.stacked
    return tuple(torch.stack(pair, 2) for pair in zip(state.weights, state.momentum))


def _unstacked(stacked) -> tuple[tuple, tuple]:
    """`state_stacks`'s inverse: (weights, momenta), views."""
    return tuple(s[:, :, 0] for s in stacked), tuple(s[:, :, 1] for s in stacked)


def chunked_memory(state: MemoryState, q, k, v, theta, log_eta, log_keep, chunk: int,
                   rule: UpdateRule = UpdateRule(), compiled: bool = False, checkpoint_chunks: int = 0):
    """Read and write a stream. q (B, H, T, d) are the new tokens' queries; k, v, theta,
    log_eta, log_keep cover pending + new tokens (p + T). Returns y (B, H, T, d), new state
    (its `conv` unchanged), the share of surprise sums clipped (0-dim; None without
    `rule.max_update_norm`)."""
    pending = state.pending[0].shape[2]
    q = F.pad(q, (0, 0, pending, 0))  # placeholder queries for the pending tokens
    total = q.shape[2]
    full = total - total % chunk
    if rule.read_after_write and full < total:
        raise ValueError(f"a read-after-write memory takes whole chunks: {total} tokens is not a multiple of "
                         f"chunk_size {chunk}")
    chunks = full // chunk
    stacked = state_stacks(state)
    if rule.gates == "token" and rule.backend == "auto":  # once per call, not per chunk
        rule = rule._replace(backend=token_step_backend("auto", stacked[0]))
    whole = None
    if rule.whole_sequence and chunks:
        q_w, k_w, v_w, *gates = (t[:, :, :full].unflatten(2, (-1, chunk)) for t in (q, k, v, theta, log_eta, log_keep))
        whole = whole_sequence_chunks(stacked, q_w, k_w, v_w, *chunk_gates(*gates, rule.gates), rule,
                                      max(checkpoint_chunks, 1))
    step = compiled_chunk_step() if compiled else chunk_step
    group = checkpoint_chunks if checkpoint_chunks and torch.is_grad_enabled() else max(chunks, 1)
    # groups of G chunks as views (split: one concatenation of their gradients in backward)
    groups = zip(*(t[:, :, :full].unflatten(2, (-1, chunk)).split(group, 2)
                   for t in (q, k, v, theta, log_eta, log_keep)))
    outputs, clipped = [], 0
    if whole is not None:
        outputs, stacked, groups, clipped = [whole[0].flatten(2, 3)], whole[1], (), whole[2]
    for inputs in groups:
        args = (step, stacked, *inputs, rule)
        ys, stacked, clipped_group = checkpoint(run_chunks, *args, use_reentrant=False) \
            if group < chunks else run_chunks(*args)
        outputs += ys
        clipped = clipped + clipped_group
    new_pending = tuple(t[:, :, full:] for t in (k, v, theta, log_eta, log_keep))
    new_state = stacked_state(stacked, new_pending, state.conv)
    if full < total:
        outputs.append(mlp_forward(new_state.weights, q[:, :, full:], rule.residual)[0])
    y = (outputs[0] if len(outputs) == 1 else torch.cat(outputs, 2))[:, :, pending:]  # no copy of a lone part
    return y, new_state, _clipped_share(clipped, chunks, new_state.weights, rule)


def _clipped_share(clipped, chunks: int, weights, rule: UpdateRule):
    """The share of a call's surprise sums the bound clipped (None without one): `clipped` of the
    chunks' sums, one per batch row, head and weight matrix (two with the per-token rule)."""
    sums = chunks * sum(w.shape[0] * w.shape[1] for w in weights) * (2 if rule.gates == "token" else 1)
    return clipped / max(sums, 1) if rule.max_update_norm else None


def whole_chunks_memory(state: MemoryState, q, k, v, token_weights, decays, rule: UpdateRule,
                        checkpoint_chunks: int = 0):
    """Read and write whole chunks already laid out for the whole-sequence kernels (q, k, v
    (B, H, N, C, d), `chunk_gates`' token weights and decays; e.g. `kernels.memory_inputs`'),
    entering a state with nothing pending. Returns (y (B, H, N C, d), new state, share clipped)
    as `chunked_memory`, or None (with its warning) where the kernels cannot take the call."""
    stacked = state_stacks(state)
    whole = whole_sequence_chunks(stacked, q, k, v, token_weights, decays, rule, max(checkpoint_chunks, 1))
    if whole is None:
        return None
    y, stacked, clipped = whole
    new_state = stacked_state(stacked, state.pending, state.conv)
    return y.flatten(2, 3), new_state, _clipped_share(clipped, q.shape[2], new_state.weights, rule)
