"""The fused chunk step of the per-token write rule (kernels/token_step.py): the torch reference
with its hand-written backward against autograd through the memory's own `chunk_step`
(float64), the Triton kernels against the reference (TRITON_INTERPRET=1 on CPU), the dispatch
from `chunk_step`, its fallbacks, and a whole NeuralMemory layer on the fused backends."""

from __future__ import annotations

import os
import types

import torch

if not torch.cuda.is_available():  # as conftest.py: before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kernels  # noqa: E402
from kernels import token_step as ts  # noqa: E402
from kernels.auto_table import AUTO_TABLE  # noqa: E402
from models.memory.chunk_write import chunk_gates  # noqa: E402
from models.memory.chunk_loop import chunk_step, UpdateRule  # noqa: E402
from models.memory.neural_memory import NeuralMemory, NeuralMemoryConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def step_inputs(depth, batch=2, heads=2, chunk=5, dim=4, hidden=8, dtype=torch.float64, seed=0):
    """(state, q, k, v, token_weights, mix): state per matrix (B, H, 2, in, out), the gates'
    weights and mix from `chunk_gates` with lively gates (every term of the mix non-trivial)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(dim, dim)] if depth == 1 else [(dim, hidden)] + [(hidden, hidden)] * (depth - 2) + [(hidden, dim)]
    state = [torch.randn(batch, heads, 2, i, o, generator=g, dtype=dtype) * i ** -0.5 for i, o in shapes]
    q, k, v = (torch.randn(batch, heads, chunk, dim, generator=g, dtype=dtype) for _ in range(3))
    theta = 0.5 * torch.rand(batch, heads, 1, chunk, generator=g, dtype=dtype)
    log_eta = torch.rand(batch, heads, 1, chunk, generator=g, dtype=dtype).clamp_min(0.1).log()
    log_keep = (1 - 0.5 * torch.rand(batch, heads, 1, chunk, generator=g, dtype=dtype)).log()
    token_weights, mix = chunk_gates(theta, log_eta, log_keep, "token")
    return [s.to(DEVICE) for s in state], *(t.to(DEVICE) for t in (q, k, v, token_weights[:, :, 0], mix[:, :, 0]))


def run_step(fn, inputs, residual=False, seed=1, input_dtype=None):
    """fn's (y, *new state) and the gradients of a random linear loss of all of them with
    respect to (*state, q, k, v, token_weights, mix)."""
    state, *rest = inputs
    if input_dtype is not None:
        rest = [t.to(input_dtype) for t in rest[:4]] + [rest[4]]
    leaves = [t.detach().clone().requires_grad_() for t in (*state, *rest)]
    depth = len(state)
    y, new = fn(tuple(leaves[:depth]), *leaves[depth:], residual)
    g = torch.Generator().manual_seed(seed)
    outputs = [y, *new]
    loss = sum((t * torch.randn(t.shape, generator=g, dtype=torch.float64).to(t)).sum() for t in outputs)
    return outputs + list(torch.autograd.grad(loss, leaves))


def through_chunk_step(state, q, k, v, token_weights, mix, residual):
    y, new, _ = chunk_step(state, q, k, v, token_weights, mix, UpdateRule(residual=residual))
    return y, new


NAMES = ["y"] + [f"new_{i}" for i in range(3)]


def max_differences(got, want):
    return [(a - b).abs().max().item() for a, b in zip(got, want)]


CASES = [(1, False), (1, True), (2, False), (2, True)]


@pytest.mark.parametrize("depth,residual", CASES)
def test_fused_reference_equals_autograd_through_chunk_step_in_float64(depth, residual):
    inputs = step_inputs(depth)
    want = run_step(through_chunk_step, inputs, residual)
    for fn in (ts.token_step_fused_torch, ts.token_step_torch):
        got = run_step(fn, inputs, residual)
        assert len(got) == len(want) == 1 + depth + depth + 5
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype == torch.float64
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
        # every output and gradient is non-trivial, so the comparison can fail
        assert all(b.abs().max() > 1e-3 for b in want)


def test_fused_reference_gradcheck():
    state, *rest = step_inputs(2, batch=1, heads=1, chunk=3, dim=3, hidden=4, seed=5)
    leaves = [t.detach().clone().requires_grad_() for t in (*state, *rest)]

    def fn(s1, s2, q, k, v, tw, mix):
        y, new = ts.token_step_fused_torch((s1, s2), q, k, v, tw, mix, True)
        return y, *new

    assert torch.autograd.gradcheck(fn, leaves)


def test_the_fused_reference_saves_no_per_token_activation():
    inputs = step_inputs(2)
    leaves = [t.detach().clone().requires_grad_() for t in (*inputs[0], *inputs[1:])]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ts.token_step_fused_torch(tuple(leaves[:2]), *leaves[2:])
    assert len(saved) == len(leaves) and all(any(s is leaf for leaf in leaves) for s in saved)


@pytest.mark.parametrize("depth,residual", CASES)
@pytest.mark.parametrize("shape", [dict(chunk=5, dim=4, hidden=8), dict(chunk=16, dim=16, hidden=32, batch=1)], ids=str)
def test_triton_equals_the_fused_reference_in_fp32(depth, residual, shape):
    inputs = step_inputs(depth, dtype=torch.float32, **shape)
    want = run_step(ts.token_step_fused_torch, inputs, residual)
    got = run_step(ts.token_step_triton, inputs, residual)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.float32
        scale = b.abs().max()
        torch.testing.assert_close(a / scale, b / scale, atol=2e-5, rtol=0)


@pytest.mark.parametrize("depth", [1, 2])
def test_triton_with_bf16_inputs_equals_the_fused_reference(depth):
    inputs = step_inputs(depth, dtype=torch.float32)
    want = run_step(ts.token_step_fused_torch, inputs, True, input_dtype=torch.bfloat16)
    got = run_step(ts.token_step_triton, inputs, True, input_dtype=torch.bfloat16)
    outputs = 1 + depth
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype
        scale = b.float().abs().max()
        # y and the new state are fp32 (fp32 arithmetic on the same bf16 inputs); the gradients
        # of bf16 inputs are rounded to bf16
        atol = 2e-5 if i < outputs or b.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(a.float() / scale, b.float() / scale, atol=atol, rtol=0)
    assert got[outputs + depth].dtype == torch.bfloat16  # d q
    assert got[0].dtype == torch.float32  # y in the state dtype


@pytest.mark.parametrize("change,match", [
    (dict(depth=3), "depth 3"),
    (dict(dim=128), "head_dim 128"),
    (dict(hidden=512), "hidden 512"),
    (dict(chunk=65), "chunk 65"),
    (dict(dtype=torch.float64), "float32 state"),
])
def test_triton_refuses_what_it_cannot_take(change, match):
    kw = dict(depth=2, chunk=4, dim=4, hidden=8, batch=1, heads=1, dtype=torch.float32) | change
    inputs = step_inputs(**kw)
    with pytest.raises(ValueError, match=match):
        ts.token_step_triton(tuple(inputs[0]), *inputs[1:])


@pytest.mark.parametrize("dim,hidden,chunk,fits", [
    (64, 256, 16, True), (64, 256, 32, True), (64, 128, 64, True), (32, 256, 64, True), (64, 256, 64, False),
    (64, 256, 33, False),  # padded to 64
])
def test_triton_refuses_tiles_past_the_measured_shared_memory(dim, hidden, chunk, fits):
    """The H100 measurements in MAX_TILE_VOLUME's comment: these four launched, (64, 256, 64)
    asked for 266,240 B of the 232,448 B a block has."""
    inputs = step_inputs(2, batch=1, heads=1, chunk=chunk, dim=dim, hidden=hidden, dtype=torch.float32)
    reason = ts.triton_refusal(tuple(inputs[0]), *inputs[1:])
    assert (reason is None) == fits, reason
    if not fits:
        assert "shared memory" in reason and "lower the chunk" in reason


def test_autocast_is_turned_off_without_a_call_dynamo_cannot_trace(monkeypatch):
    """torch 2.11's dynamo cannot trace torch.amp.is_autocast_available (the compiled Titans
    model failed there): `full_precision` reads the table made at import, and still turns a
    bf16 autocast off where one exists and does nothing on meta."""
    def untraceable(device_type):
        raise AssertionError("is_autocast_available called inside the step")

    monkeypatch.setattr(torch.amp, "is_autocast_available", untraceable)
    a = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
        with kernels.full_precision(a.device):
            assert (a @ a).dtype == torch.float32
    with kernels.full_precision(torch.device("meta")):
        assert (a.to("meta") @ a.to("meta")).device.type == "meta"


def test_triton_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    inputs = step_inputs(2, dtype=torch.float32)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="need a CUDA device"):
            ts.token_step_triton(tuple(inputs[0]), *inputs[1:])
    assert ts.triton_refusal(tuple(inputs[0]), inputs[1].cpu()) is not None


@pytest.fixture
def calls(monkeypatch):
    """Counts of the implementations' calls (patched where `kernels.token_chunk_step` looks
    them up)."""
    counts = {"token_step_fused_torch": 0, "token_step_triton": 0, "token_step_torch": 0}
    for name in counts:
        original = getattr(kernels, name)

        def counting(*args, _name=name, _original=original, **kw):
            counts[_name] += 1
            return _original(*args, **kw)

        monkeypatch.setattr(kernels, name, counting)
    return counts


@pytest.mark.parametrize("backend,ran", [("fused_torch", "token_step_fused_torch"), ("triton", "token_step_triton"),
                                         ("auto", None), ("torch", None)])
def test_chunk_step_dispatches_to_the_backend_it_names(calls, backend, ran):
    inputs = step_inputs(2, dtype=torch.float32)
    want = run_step(through_chunk_step, inputs)

    def step(state, q, k, v, tw, mix, residual):
        y, new, clipped = chunk_step(state, q, k, v, tw, mix, UpdateRule(backend=backend))
        assert clipped is None
        return y, new

    got = run_step(step, inputs)
    assert calls == {name: int(name == ran) for name in calls}
    for a, b in zip(got, want):
        scale = b.abs().max()
        torch.testing.assert_close(a / scale, b / scale, atol=2e-5, rtol=0)


@pytest.mark.parametrize("rule,depth,match", [
    (dict(max_update_norm=0.1), 2, "max_update_norm"),
    (dict(read_after_write=True), 2, "read_after_write"),
    (dict(), 3, "depth 3"),
])
@pytest.mark.parametrize("backend", ["fused_torch", "triton"])
def test_unsupported_configs_fall_back_to_the_unfused_step(calls, rule, depth, match, backend):
    inputs = step_inputs(depth, dtype=torch.float32)
    rule = UpdateRule(**rule)
    state, *rest = inputs
    want = chunk_step(tuple(state), *rest, rule)
    with pytest.warns(UserWarning, match=match):
        got = chunk_step(tuple(state), *rest, rule._replace(backend=backend))
    assert calls == {name: 0 for name in calls}
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert (got[2] is None) == (want[2] is None)


def test_auto_never_resolves_to_a_fused_token_step():
    assert not [key for key in AUTO_TABLE if key[1] == "token_step"]
    assert kernels.token_step_backend("auto", torch.zeros(2, 2, 4, 8)) == "torch"
    fake_cuda = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"), shape=(4, 4, 64, 256), is_cuda=True,
                                      dtype=torch.float32)
    assert kernels.token_step_backend("auto", fake_cuda) == "compiled"
    with pytest.raises(ValueError, match="unknown"):
        kernels.token_step_backend("triton_blocked", fake_cuda)


def test_token_chunk_step_backends_agree():
    inputs = step_inputs(2, dtype=torch.float64)
    want = run_step(lambda *a: kernels.token_chunk_step(*a, backend="torch"), inputs, True)
    got = run_step(lambda *a: kernels.token_chunk_step(*a, backend="fused_torch"), inputs, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def layer_fwd_bwd(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    # unbounded: the fused step has no surprise bound (it would fall back to the unfused step)
    cfg = dict(dim=12, n_heads=2, head_dim=4, depth=2, expansion=2, chunk_size=3, max_lr=0.5, max_update_norm=0.0) | kw
    memory = NeuralMemory(NeuralMemoryConfig(**cfg)).to(dtype)
    with torch.no_grad():  # livelier gates than the defaults, so every term matters
        memory.to_gates.weight.normal_(std=0.5)
    x = torch.randn(2, 8, 12, dtype=dtype, generator=torch.Generator().manual_seed(1))  # 8 tokens: a pending 2
    y, state = memory(x)
    loss = (y * torch.randn(y.shape, dtype=dtype, generator=torch.Generator().manual_seed(2))).sum() \
        + sum(w.sum() for w in state.weights) + sum(s.square().sum() for s in state.momentum)
    loss.backward()
    return [y, *state.weights, *state.momentum] + [p.grad for p in memory.parameters()]


@pytest.mark.parametrize("cfg", [dict(), dict(depth=1, residual=True)], ids=str)
def test_a_layer_on_the_fused_torch_backend_equals_the_default_in_float64(calls, cfg):
    want = layer_fwd_bwd(**cfg)
    assert calls["token_step_fused_torch"] == 0
    got = layer_fwd_bwd(kernel_backend="fused_torch", **cfg)
    assert calls["token_step_fused_torch"] == 2  # two whole chunks of 3 in 8 tokens
    assert all(g is not None for g in got)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_a_layer_on_the_triton_backend_equals_the_default_in_fp32(calls):
    want = layer_fwd_bwd(torch.float32)
    got = layer_fwd_bwd(torch.float32, kernel_backend="triton")
    assert calls["token_step_triton"] == 2
    for a, b in zip(got, want):
        scale = b.abs().max()
        torch.testing.assert_close(a / scale, b / scale, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["fused_torch", "triton"])
def test_chunk_step_with_a_fused_backend_traces_into_one_graph(backend):
    """fullgraph: "fused_torch" traces its autograd.Function; "triton" is refused inside a
    compiled region (the unfused step is traced instead, without a warning)."""
    torch._dynamo.reset()
    inputs = step_inputs(2)
    want = run_step(through_chunk_step, inputs)
    compiled = torch.compile(chunk_step, backend="aot_eager", fullgraph=True)

    def step(state, q, k, v, tw, mix, residual):
        y, new, _ = compiled(state, q, k, v, tw, mix, UpdateRule(backend=backend))
        return y, new

    got = run_step(step, inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", ["fused_torch", "triton"])
def test_the_fused_step_keeps_a_float32_state_under_bf16_autocast(backend):
    inputs = step_inputs(2, dtype=torch.float32)
    want = run_step(lambda *a: kernels.token_chunk_step(*a, backend=backend), inputs)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = run_step(lambda *a: kernels.token_chunk_step(*a, backend=backend), inputs)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=0, rtol=0)
