"""Issue 29: every `fullgraph` compile in models/ and kernels/ (`kernels.bounded_compile`:
the memory's `compiled_chunk_step` and the kernels' "compiled" backends) meets more than
torch's default 8 shapes in one process without failing, and gives the eager results.

The failure was dynamo's (its recompile limit), whatever the backend, so these tests compile
with the "aot_eager" backend: dynamo's guards, recompiles and AOTAutograd's forward/backward
split, without Inductor's C++ code generation (24 Inductor graphs took about 40 min of this
2-core machine). Inductor's numerics are tested once per path elsewhere
(tests/test_neural_memory.py, tests/test_triton_kernels.py, both slow).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import kernels
from kernels.reference import memory_update_reference, newton_schulz_reference
from models.memory import chunk_loop
from models.memory.neural_memory import NeuralMemory, NeuralMemoryConfig

BASE = dict(dim=16, n_heads=2, head_dim=8, depth=2, expansion=2, chunk_size=4)
# (config changes, batch, dtype): batch, heads, chunk, width, depth, dtype and the write rule
# each give the compiled chunk step new graphs (two per row: the first chunk's momentum
# does not require grad); 12 rows, 24 graphs, three times torch's default limit of 8.
SHAPES = [
    ({}, 2, torch.float32),
    ({}, 3, torch.float32),
    ({}, 1, torch.float32),
    (dict(n_heads=4), 2, torch.float32),
    (dict(chunk_size=2), 2, torch.float32),
    (dict(chunk_size=8), 2, torch.float32),
    (dict(head_dim=4), 2, torch.float32),
    (dict(expansion=4), 2, torch.float32),
    (dict(depth=1), 2, torch.float32),
    (dict(depth=3), 2, torch.float32),
    ({}, 2, torch.float64),
    (dict(gates="chunk", newton_schulz_steps=2, kernel_backend="compiled"), 2, torch.float32),
]


def fell_back(caught) -> list[str]:
    """The messages of `bounded_compile`'s warning that new shapes run eagerly."""
    return [str(w.message) for w in caught if "compiled graphs, the bound" in str(w.message)]


def forward_backward(memory: NeuralMemory, x: torch.Tensor) -> list[torch.Tensor]:
    """The layer's output and its input's and parameters' gradients after one backward."""
    memory.zero_grad()
    x = x.detach().requires_grad_()
    y, _ = memory(x)
    y.square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in memory.parameters()]


@pytest.fixture
def aot_eager_compiles(monkeypatch):
    """The model's and the kernels' compiled callables, built by `bounded_compile` as in
    production but with the "aot_eager" backend (module docstring); fresh for each test."""
    step = kernels.bounded_compile(chunk_loop.chunk_step, backend="aot_eager")
    monkeypatch.setattr(chunk_loop, "compiled_chunk_step", lambda: step)
    monkeypatch.setattr(kernels, "_compiled", functools.cache(lambda fn: kernels.bounded_compile(fn, backend="aot_eager")))


def test_compiled_chunk_step_runs_twelve_shapes_in_one_process(aot_eager_compiles):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for changes, batch, dtype in SHAPES:
            torch.manual_seed(0)
            cfg = dict(BASE, **changes)
            eager = NeuralMemory(NeuralMemoryConfig(**cfg)).to(dtype)
            compiled = NeuralMemory(NeuralMemoryConfig(**cfg, compiled_chunk_step=True)).to(dtype)
            compiled.load_state_dict(eager.state_dict())
            x = torch.randn(batch, 4 * cfg["chunk_size"] + 1, cfg["dim"], dtype=dtype)  # 4 chunks + a pending token
            tolerance = 1e-9 if dtype == torch.float64 else 1e-4
            for a, b in zip(forward_backward(eager, x), forward_backward(compiled, x), strict=True):
                torch.testing.assert_close(b, a, rtol=tolerance, atol=tolerance * max(1.0, a.abs().max().item()))
    assert not fell_back(caught)  # all 24 graphs fit the bound: none ran eagerly


def test_compiled_kernel_backends_run_twelve_shapes_in_one_process(aot_eager_compiles):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows, cols, batch in [(4, 4, 1), (4, 8, 1), (8, 4, 1), (4, 4, 2), (4, 8, 2), (8, 4, 2),
                                  (2, 6, 1), (6, 2, 1), (2, 6, 3), (6, 2, 3), (3, 5, 2), (5, 3, 2)]:
            x = torch.randn(batch, rows, cols)
            torch.testing.assert_close(kernels.newton_schulz(x, 2, "compiled"), newton_schulz_reference(x, 2))
            momentum, grad, eta, alpha = torch.randn_like(x), torch.randn_like(x), torch.rand(batch), torch.rand(batch)
            expected = memory_update_reference(x, momentum, grad, eta, alpha, 1)
            for a, b in zip(kernels.memory_update(x, momentum, grad, eta, alpha, 1, "compiled"), expected, strict=True):
                torch.testing.assert_close(a, b)
    assert not fell_back(caught)


def test_past_its_bound_a_compiled_function_warns_once_and_runs_eagerly():
    def scaled_sum(x):
        return (2 * x).sum(-1)

    compiled = kernels.bounded_compile(scaled_sum, limit=2)
    inputs = [torch.randn(n) for n in (3, 4, 5, 6, 3, 5)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [compiled(x) for x in inputs]
    messages = fell_back(caught)
    assert len(messages) == 1 and messages[0].startswith(f"{scaled_sum.__qualname__}: 2 compiled graphs")
    for x, y in zip(inputs, results, strict=True):
        torch.testing.assert_close(y, 2 * x.sum(-1))
