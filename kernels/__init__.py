"""Triton kernels, each with a plain torch reference beside it, behind one entry point per op.

- `newton_schulz(x, steps, backend)`: Muon's Newton-Schulz iteration.
- `memory_update(weight, momentum, grad, eta, alpha, ns_steps, backend, step_scale)`: the
  memory's per-chunk step S' = eta S - G, M' = (1 - alpha) M + step_scale NS(S'), fused in one kernel.
- `token_chunk_step(state, q, k, v, token_weights, mix, residual, backend)`: one chunk of the
  memory's per-token rule (read, explicit backward, weighted sums, mix; kernels/token_step.py).
  "torch" / "compiled": the plain torch forward differentiated by autograd (the computation of
  the memory's own unfused `chunk_step`, written apart), "fused_torch": the torch reference
  with its hand-written backward, "triton": the fused kernels (the Hugging Face export ships
  the file; without triton only its torch paths). "auto" looks up op "token_step" in the auto table,
  which has no entry for it (never measured on a GPU), so it resolves to the device default,
  never to a fused path; `token_step_refusal` says why a fused backend cannot take a step.
- `kernels.whole_sequence.whole_sequence_memory(...)`: every chunk of a memory call in one
  forward and one backward launch (kernels/whole_sequence.py; used by the neural memory's
  `whole_sequence` option, not by "auto").
- `kernels.memory_inputs.chunk_inputs(...)`: the whole-sequence kernels' inputs from the memory's
  projections in one launch, for either write rule, with or without the conv (kernels/memory_inputs.py);
  its backward one launch too.
backend "auto" runs what was measured fastest (`kernels/auto_table.py`): a table of (device
kind, op, shape class) -> backend, compiled torch on CUDA where no kernel was measured
faster (today everywhere: on an H100 the Triton paths were 1.2-2.3x slower for training),
the eager torch reference on any other device and wherever the Triton kernels cannot be
imported. A Triton choice a call cannot take (a dtype other than fp32 / bf16, matrices
over the per-matrix tile, no blocked path for `memory_update`) falls back to the device's
default. "triton" (per matrix: up to 128 x 512, either orientation), "triton_blocked"
(blocked, any size, `newton_schulz` only), "torch" (eager reference) and "compiled" (the
reference through `bounded_compile`: one graph per shape, up to COMPILED_GRAPH_LIMIT,
then eager) force one. Tests force the Triton backends on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import warnings

import torch

from kernels.auto_table import AUTO_TABLE, DEVICE_DEFAULTS, MANY_MATRICES, MAX_COLS, MAX_ROWS
from kernels.reference import MUON_COEFFICIENTS, memory_update_reference, newton_schulz_reference
from kernels.token_step import full_precision, token_step_fused_torch, token_step_torch, token_step_triton, triton_refusal

BACKENDS = ("auto", "triton", "triton_blocked", "torch", "compiled")  # newton_schulz
MEMORY_UPDATE_BACKENDS = tuple(b for b in BACKENDS if b != "triton_blocked")
TOKEN_STEP_BACKENDS = ("auto", "torch", "compiled", "fused_torch", "triton")
FUSED_TOKEN_STEP_BACKENDS = ("fused_torch", "triton")  # the backends `token_chunk_step` runs fused


COMPILED_GRAPH_LIMIT = 64  # graphs one compiled function keeps before new shapes run eagerly


def bounded_compile(fn, limit: int = COMPILED_GRAPH_LIMIT, backend: str = "inductor"):
    """`torch.compile(fn, dynamic=False, fullgraph=True)` that never fails on a new shape.

    Each new input signature (shapes, strides, dtypes, requires_grad, non-tensor arguments)
    compiles one more static graph. torch's default, one `recompile_limit` of 8 per code
    object shared by every `torch.compile` of it, makes a fullgraph compile raise
    `FailOnRecompileLimitHit` at the ninth (issue 29). Here the callable gets its own
    recompile region (`isolate_recompiles`) and `limit` graphs; past them it warns once and
    runs new shapes eagerly, graphs already compiled still serving theirs (dynamo's
    "eager_on_recompile" stance). Inside another compiled region it is `fn` itself, traced
    into the outer graph. Compile time per new shape, step time and why static shapes
    rather than a dynamic batch: `compiled_chunk_step` in models/memory/neural_memory.py.
    `backend` is torch.compile's (tests use "aot_eager": dynamo's guards and recompiles, which
    the bound is about, without Inductor's code generation). On a torch without per-function
    `recompile_limit` / `isolate_recompiles` (before 2.13) it compiles without them and torch's
    shared limit applies (that path is not tested here: the project pins torch 2.13).
    """
    try:
        compiled = torch.compile(fn, dynamic=False, fullgraph=True, backend=backend, recompile_limit=limit,
                                 isolate_recompiles=True)
    except TypeError:  # torch < 2.13: no per-function limit
        compiled = torch.compile(fn, dynamic=False, fullgraph=True, backend=backend)
    from torch._dynamo.exc import FailOnRecompileLimitHit  # here, not at import: dynamo costs ~3.5 s to import

    past_limit = False

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal past_limit
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if past_limit:
            with torch.compiler.set_stance("eager_on_recompile"):
                return compiled(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except FailOnRecompileLimitHit:
            past_limit = True
            warnings.warn(f"{fn.__qualname__}: {limit} compiled graphs, the bound: new shapes run eagerly from now on "
                          "(kernels.COMPILED_GRAPH_LIMIT)", stacklevel=2)
            return fn(*args, **kwargs)

    return run


@functools.cache
def _compiled(fn):
    """`fn` through `bounded_compile`, one per function (inside a compiled region the ops call
    the reference directly, traced into the outer graph)."""
    return bounded_compile(fn)


@functools.cache
def _triton_module():
    """The Triton kernels module, or None where it cannot be imported: triton is not
    installed, or this is a Hugging Face export (it ships the torch paths only)."""
    try:
        return importlib.import_module("kernels.triton_kernels")
    except ImportError:
        return None


def _triton(op: str):
    module = _triton_module()
    if module is None:
        raise RuntimeError(f"{op}: the Triton kernels cannot be imported here (no triton, or an exported model): "
                           "use backend='torch'")
    return module


def _triton_kernels_present() -> bool:
    """Whether triton and kernels/triton_kernels.py are here, found without importing either
    (a Hugging Face export ships neither): "auto" decides on this flag, which a compiled
    region reads as a constant, where importing under a trace would break the graph."""
    try:
        return None not in (importlib.util.find_spec(f"{__name__}.triton_kernels"), importlib.util.find_spec("triton"))
    except ModuleNotFoundError:  # an export's flattened kernels module is no package
        return False


TRITON_KERNELS = _triton_kernels_present()


def _fits_tile(x: torch.Tensor) -> bool:
    small, large = sorted(x.shape[-2:])
    return small <= MAX_ROWS and large <= MAX_COLS


def shape_class(x: torch.Tensor) -> str:
    """The auto table's class of x (..., rows, cols): "tile" when each matrix fits one
    per-matrix Triton program, else "large"; "-many" past MANY_MATRICES matrices, else "-few"."""
    size = "tile" if _fits_tile(x) else "large"
    return f"{size}-{'many' if math.prod(x.shape[:-2]) > MANY_MATRICES else 'few'}"


def can_run(backend: str, x: torch.Tensor, choices: tuple[str, ...]) -> bool:
    """Whether `backend`, one of the op's `choices`, takes x where "auto" would run it: the
    Triton kernels need a CUDA tensor in fp32 or bf16, the per-matrix one matrices within its tile."""
    if backend not in choices:
        return False
    if backend.startswith("triton"):
        fits = backend == "triton_blocked" or _fits_tile(x)
        return x.is_cuda and x.dtype in (torch.float32, torch.bfloat16) and fits
    return True


def _resolve(op: str, backend: str, x: torch.Tensor, choices: tuple[str, ...]) -> str:
    """The backend that runs `op` on x (..., rows, cols): `backend` itself unless it is
    "auto", then the auto table's entry for (x's device type, op, `shape_class(x)`), else
    (no entry, or one x cannot take) the device type's default (module docstring)."""
    if backend not in choices:
        raise ValueError(f"{op}: backend '{backend}' unknown: choose one of {choices}")
    if backend != "auto":
        return backend
    if not TRITON_KERNELS:
        return "torch"
    default = DEVICE_DEFAULTS.get(x.device.type, "torch")
    chosen = AUTO_TABLE.get((x.device.type, op, shape_class(x)), default)
    return chosen if can_run(chosen, x, choices) else default


def newton_schulz(x: torch.Tensor, steps: int = 5, backend: str = "auto", coefficients=MUON_COEFFICIENTS) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration on each matrix of x (..., rows, cols)."""
    backend = _resolve("newton_schulz", backend, x, BACKENDS)
    if backend == "triton":
        return _triton("newton_schulz").newton_schulz_triton(x.contiguous(), steps, coefficients)
    if backend == "triton_blocked":
        return _triton("newton_schulz").newton_schulz_blocked(x.contiguous(), steps, coefficients)
    compiled = backend == "compiled" and not torch.compiler.is_compiling()
    reference = _compiled(newton_schulz_reference) if compiled else newton_schulz_reference
    return reference(x, steps, coefficients)


def memory_update(weight, momentum, grad, eta, alpha, ns_steps: int, backend: str = "auto", step_scale: float = 1.0):
    """(new weight, new momentum) of one chunk step; see kernels/reference.py."""
    backend = _resolve("memory_update", backend, weight, MEMORY_UPDATE_BACKENDS)
    if backend == "triton":
        return _triton("memory_update").memory_update_triton(weight.contiguous(), momentum.contiguous(),
                                                              grad.contiguous(), eta, alpha, ns_steps, step_scale)
    compiled = backend == "compiled" and not torch.compiler.is_compiling()
    reference = _compiled(memory_update_reference) if compiled else memory_update_reference
    return reference(weight, momentum, grad, eta, alpha, ns_steps, step_scale)


def token_step_backend(backend: str, weight: torch.Tensor) -> str:
    """The backend that runs a per-token chunk step whose first weight matrix is `weight`
    (..., in, out): `backend` itself unless "auto" (then the auto table's "token_step" entry,
    else the device default: never a fused backend until one is measured faster)."""
    return _resolve("token_step", backend, weight, TOKEN_STEP_BACKENDS)


def token_step_refusal(backend: str, state, q, k=None, v=None, token_weights=None, mix=None) -> str | None:
    """Why the fused `backend` ("fused_torch" / "triton") cannot take this chunk step, or None
    when it can (shapes as `token_chunk_step`). Other backends: None."""
    if backend == "fused_torch":
        return None if len(state) in (1, 2) else f"depth {len(state)}: the fused step takes depth 1 or 2"
    if backend == "triton":
        if torch.compiler.is_compiling():
            return "inside torch.compile (the Triton kernels run eagerly only)"
        if not TRITON_KERNELS:
            return "the Triton kernels cannot be imported here"
        return triton_refusal(state, q, k, v, token_weights, mix)
    return None


def token_chunk_step(state, q, k, v, token_weights, mix, residual: bool = False, backend: str = "auto"):
    """One chunk of the memory's per-token rule (kernels/token_step.py states it): state, one
    (B, H, 2, in, out) stacked [M; S] per weight matrix; q, k, v (B, H, C, d); token_weights
    (B, H, C, 2); mix (B, H, 2, 2). Returns (y (B, H, C, d), new state). A fused backend that
    cannot take the step raises ValueError (`token_step_refusal` tells beforehand)."""
    backend = token_step_backend(backend, state[0])
    if backend == "triton":
        return token_step_triton(state, q, k, v, token_weights, mix, residual)
    if backend == "fused_torch":
        return token_step_fused_torch(state, q, k, v, token_weights, mix, residual)
    compiled = backend == "compiled" and not torch.compiler.is_compiling()
    reference = _compiled(token_step_torch) if compiled else token_step_torch
    return reference(state, q, k, v, token_weights, mix, residual)
