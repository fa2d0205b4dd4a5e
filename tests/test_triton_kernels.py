"""The Triton kernels (Newton-Schulz, fused memory update) against their torch references
(TRITON_INTERPRET=1 on CPU).

fp32 tolerances: forward 1e-4 absolute, gradients 1e-4 relative to their scale."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import newton_schulz_reference

# interpreted on CPU: see conftest.py
from kernels.triton_kernels import newton_schulz_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (1, 64, 256): four column blocks of 64; (1, 100, 300), (1, 300, 100): BLOCK_R 128, ten 32-column blocks
SHAPES = [(3, 16, 16), (2, 20, 48), (2, 48, 20), (4, 2, 17, 33), (1, 64, 256), (1, 100, 300), (1, 300, 100)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_matches_reference(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    torch.testing.assert_close(newton_schulz_triton(x, 5), newton_schulz_reference(x, 5), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_backward_matches_autograd_through_reference(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    leaf_kernel, leaf_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    newton_schulz_triton(leaf_kernel, 5).backward(grad)
    newton_schulz_reference(leaf_ref, 5).backward(grad)
    scale = leaf_ref.grad.abs().max()
    torch.testing.assert_close(leaf_kernel.grad / scale, leaf_ref.grad / scale, atol=1e-4, rtol=0)


def test_bf16_input_accumulates_in_fp32():
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = newton_schulz_triton(x.bfloat16(), 5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), newton_schulz_reference(x, 5), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("bad,message", [
    (lambda: torch.randn(4, 4, dtype=torch.float64), "float32 or bfloat16"),
    (lambda: torch.randn(8), "rows, cols"),
    (lambda: torch.randn(32, 16).t(), "contiguous"),
    (lambda: torch.randn(200, 600), "exceed"),
])
def test_bad_input_names_the_argument(bad, message):
    with pytest.raises((TypeError, ValueError), match=message):
        newton_schulz_triton(bad().to(DEVICE), 5)


def test_memory_module_gives_the_same_outputs_and_gradients_on_both_paths():
    from models.memory.neural_memory import NeuralMemory, NeuralMemoryConfig

    results = []
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        memory = NeuralMemory(NeuralMemoryConfig(dim=32, n_heads=2, head_dim=16, depth=2, expansion=2, chunk_size=4,
                                                 gates="chunk", newton_schulz_steps=5, kernel_backend=backend)).to(DEVICE)
        x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        y, _ = memory(x)
        y.square().sum().backward()
        results.append([y.detach()] + [p.grad for p in memory.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_bf16_memory_keeps_float32_state_through_the_triton_kernel():
    """The fused update kernel loads and stores the fast weights in float32 under a bf16 model."""
    from models.memory.neural_memory import NeuralMemory, NeuralMemoryConfig

    states = []
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        memory = NeuralMemory(NeuralMemoryConfig(dim=32, n_heads=2, head_dim=16, depth=2, expansion=2, chunk_size=4,
                                                 gates="chunk", newton_schulz_steps=5, kernel_backend=backend))
        with torch.no_grad():
            _, state = memory.to(DEVICE, torch.bfloat16)(torch.randn(2, 12, 32).to(DEVICE, torch.bfloat16))
        assert {t.dtype for t in state.weights + state.momentum} == {torch.float32}
        states.append(state.weights + state.momentum)
    for a, b in zip(*states):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_dispatch_rejects_unknown_backend():
    from kernels import newton_schulz as dispatch

    with pytest.raises(ValueError, match="backend 'cuda' unknown"):
        dispatch(torch.randn(4, 4), 5, backend="cuda")


UPDATE_SHAPES = [(2, 3, 16, 32), (2, 3, 32, 16), (1, 2, 20, 36), (1, 2, 150, 80)]


def update_inputs(shape, seed=4):
    g = torch.Generator().manual_seed(seed)
    weight, momentum, grad = (torch.randn(shape, generator=g).to(DEVICE) for _ in range(3))
    eta, alpha = (torch.rand(shape[:-2], generator=g).to(DEVICE) for _ in range(2))
    return weight, momentum, grad, eta, alpha


@pytest.mark.parametrize("steps,step_scale", [(0, 1.0), (5, 1.0), (5, 0.25)])
@pytest.mark.parametrize("shape", UPDATE_SHAPES, ids=str)
def test_fused_memory_update_matches_reference(shape, steps, step_scale):
    from kernels.reference import memory_update_reference
    from kernels.triton_kernels import memory_update_triton

    inputs = update_inputs(shape)
    for got, want in zip(memory_update_triton(*inputs, steps, step_scale),
                         memory_update_reference(*inputs, steps, step_scale)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_step_scale_scales_only_the_orthogonalised_step():
    """M' = (1 - alpha) M + lr NS(S'): the retained weight and the momentum do not depend on lr."""
    from kernels.reference import memory_update_reference

    weight, momentum, grad, eta, alpha = (t.cpu().double() for t in update_inputs((2, 3, 16, 32)))
    retained = (1 - alpha)[..., None, None] * weight
    (unit, unit_momentum), (scaled, scaled_momentum) = (
        memory_update_reference(weight, momentum, grad, eta, alpha, 5, lr) for lr in (1.0, 0.25))
    torch.testing.assert_close(scaled - retained, 0.25 * (unit - retained), rtol=1e-12, atol=1e-12)
    assert torch.equal(scaled_momentum, unit_momentum)
    assert (unit - retained).norm() > 1.0  # the step is there to scale


@pytest.mark.parametrize("shape", UPDATE_SHAPES[:2], ids=str)
def test_fused_memory_update_backward_matches_autograd(shape):
    from kernels.reference import memory_update_reference
    from kernels.triton_kernels import memory_update_triton

    grads = []
    for fn in (memory_update_triton, memory_update_reference):
        leaves = [t.clone().requires_grad_() for t in update_inputs(shape)]
        new_weight, new_momentum = fn(*leaves, 5, 0.5)
        (new_weight * 1.5 + new_momentum.sin()).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for got, want in zip(*grads):
        scale = want.abs().max()
        torch.testing.assert_close(got / scale, want / scale, atol=1e-4, rtol=0)


@pytest.mark.parametrize("break_input,message", [
    (lambda w, s, g, e, a: (w, s[..., :8], g, e, a), "momentum has shape"),
    (lambda w, s, g, e, a: (w, s, g.double(), e, a), "grad must be float32"),
    (lambda w, s, g, e, a: (w, s, g, e[:1], a), "eta has shape"),
    (lambda w, s, g, e, a: (w.transpose(-1, -2), s, g, e, a), "weight must be contiguous"),
])
def test_fused_memory_update_bad_input_names_the_argument(break_input, message):
    from kernels.triton_kernels import memory_update_triton

    with pytest.raises((TypeError, ValueError), match=message):
        memory_update_triton(*break_input(*update_inputs((2, 3, 16, 16))), 5)


def test_coefficient_schedules_match_between_kernel_and_reference():
    from kernels.reference import LACT_SCHEDULE

    x = torch.randn(3, 16, 40, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    torch.testing.assert_close(newton_schulz_triton(x, 5, LACT_SCHEDULE), newton_schulz_reference(x, 5, LACT_SCHEDULE), atol=1e-4, rtol=1e-4)
    assert (newton_schulz_reference(x, 5, LACT_SCHEDULE) - newton_schulz_reference(x, 5)).abs().max() > 1e-3  # the schedule is used
    with pytest.raises(ValueError, match="3 triples for 5 steps"):
        newton_schulz_reference(x, 5, LACT_SCHEDULE[:3])


@pytest.mark.slow
def test_compiled_torch_path_matches_eager_reference():
    from kernels import memory_update
    from kernels.reference import memory_update_reference

    inputs = update_inputs((2, 2, 16, 32))
    for got, want in zip(memory_update(*inputs, 5, backend="compiled"), memory_update_reference(*inputs, 5)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_unsupported_device_is_named(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="x is on cpu: the Triton kernels need a CUDA device"):
        newton_schulz_triton(torch.randn(16, 16), 5)


# Blocked path: block 16 so that every shape has several blocks; 2 steps keep the interpreter fast.
BLOCKED_SHAPES = [(2, 40, 70), (3, 70, 40), (1, 33, 33), (2, 2, 17, 50)]


def blocked(x, steps=2, coefficients=None):
    from kernels.triton_kernels import newton_schulz_blocked

    return newton_schulz_blocked(x, steps, *([coefficients] if coefficients else []), block=16)


@pytest.mark.parametrize("shape", BLOCKED_SHAPES, ids=str)
def test_blocked_forward_matches_reference(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    torch.testing.assert_close(blocked(x), newton_schulz_reference(x, 2), atol=1e-4, rtol=1e-4)


def test_blocked_path_has_no_size_limit_and_follows_the_schedule():
    from kernels.reference import LACT_SCHEDULE
    from kernels.triton_kernels import newton_schulz_blocked

    x = torch.randn(130, 520, generator=torch.Generator().manual_seed(8)).to(DEVICE)  # over MAX_ROWS x MAX_COLS
    schedule = LACT_SCHEDULE[:1]
    torch.testing.assert_close(newton_schulz_blocked(x, 1, schedule), newton_schulz_reference(x, 1, schedule), atol=1e-4, rtol=1e-4)


def test_blocked_backward_matches_autograd_through_reference():
    x = torch.randn(2, 40, 20, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    leaf_kernel, leaf_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    blocked(leaf_kernel).backward(grad)
    newton_schulz_reference(leaf_ref, 2).backward(grad)
    scale = leaf_ref.grad.abs().max()
    torch.testing.assert_close(leaf_kernel.grad / scale, leaf_ref.grad / scale, atol=1e-4, rtol=0)


def test_blocked_bf16_input_accumulates_in_fp32():
    x = torch.randn(1, 33, 40, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    out = blocked(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), newton_schulz_reference(x, 2), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("shape,dtype", [((2, 40, 70), torch.float32), ((3, 70, 40), torch.float32),
                                         ((1, 33, 20), torch.bfloat16)], ids=str)
def test_symmetric_gram_matches_matmul(shape, dtype):
    from kernels.triton_kernels import symmetric_gram

    x = torch.randn(shape, generator=torch.Generator().manual_seed(12)).to(DEVICE, dtype)
    wide = x.float() if shape[-2] <= shape[-1] else x.float().mT
    torch.testing.assert_close(symmetric_gram(x, block=16), wide @ wide.mT, atol=1e-4, rtol=1e-5)


def test_symmetric_gram_combines_cin_alpha_beta():
    from kernels.triton_kernels import symmetric_gram

    a, s = torch.randn(2, 2, 40, 40, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    cin = s + s.mT
    torch.testing.assert_close(symmetric_gram(a, cin, alpha=2.0315, beta=-4.775, block=16),
                               -4.775 * cin + 2.0315 * a @ a.mT, atol=1e-4, rtol=1e-5)


def test_symmetric_gram_computes_upper_blocks_only_and_mirrors_them(monkeypatch):
    from kernels import triton_kernels

    grids = []
    kernel = triton_kernels._symmetric_gram_kernel
    monkeypatch.setattr(triton_kernels, "_symmetric_gram_kernel",
                        type("Spy", (), {"__getitem__": lambda self, grid: grids.append(grid) or kernel[grid]})())
    x = torch.randn(2, 40, 70, generator=torch.Generator().manual_seed(14)).to(DEVICE)
    out = triton_kernels.symmetric_gram(x, block=16)  # 3 x 3 blocks: 6 upper-triangular pairs per matrix
    assert grids == [(2, 6)]
    assert triton_kernels.upper_block_pairs(3, x.device).tolist() == [[0, 0, 0, 1, 1, 2], [0, 1, 2, 1, 2, 2]]
    assert torch.equal(out, out.mT)  # the lower blocks are the mirrored upper ones, bit for bit
    torch.testing.assert_close(out, x @ x.mT, atol=1e-4, rtol=1e-5)


def test_blocked_bad_block_is_named():
    from kernels.triton_kernels import newton_schulz_blocked

    with pytest.raises(ValueError, match="block must be a power of two >= 16"):
        newton_schulz_blocked(torch.randn(16, 16).to(DEVICE), 5, block=24)


def spy_on_blocked(monkeypatch):
    from kernels import triton_kernels

    calls, blocked_path = [], triton_kernels.newton_schulz_blocked
    monkeypatch.setattr(triton_kernels, "newton_schulz_blocked", lambda *args: calls.append(args) or blocked_path(*args))
    return calls


def test_dispatch_forces_the_blocked_path(monkeypatch):
    from kernels import newton_schulz as dispatch

    calls = spy_on_blocked(monkeypatch)
    x = torch.randn(1, 16, 24, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    torch.testing.assert_close(dispatch(x, 1, backend="triton_blocked"), newton_schulz_reference(x, 1), atol=1e-4, rtol=1e-4)
    assert len(calls) == 1


def test_memory_update_has_no_blocked_backend():
    from kernels import memory_update

    with pytest.raises(ValueError, match="backend 'triton_blocked' unknown"):
        memory_update(*update_inputs((1, 2, 16, 16)), 5, backend="triton_blocked")
