"""The memory's chunk inputs in one launch (kernels/memory_inputs.py): the Triton kernel (under
TRITON_INTERPRET=1, set by conftest.py) against the torch reference, the op's hand-written
backward against autograd through the reference in float64, and the layer through it against
the layer's own preparation (`NeuralMemory.write`) on the whole-sequence path: Mela's memory
(the chunk rule, no conv) and Titans' (the per-token rule after a conv, its history carried
from call to call)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import models.memory.neural_memory as neural_memory
from kernels.memory_inputs import chunk_inputs, chunk_inputs_reference
from models.layers.diagnostics import recording
from models.lms.mela import mela_memory
from models.memory.neural_memory import FORGET_LOGIT_OFFSET, NeuralMemory, NeuralMemoryConfig

# (qk_norm, value_silu, momentum, forget): Mela's, then every switch flipped at least once
FLAGS = [(True, False, True, True), (False, True, False, True), (True, True, True, False)]


def draw(batch, length, heads, dim, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, length, 3 * heads * dim, generator=g, dtype=torch.float64)
    logits = 2 * torch.randn(batch, length, 3 * heads, generator=g, dtype=torch.float64)
    bias = torch.randn(3 * heads, generator=g, dtype=torch.float64)
    return qkv.to(dtype), logits.to(dtype), bias.to(dtype)


def draw_conv(batch, heads, dim, taps=4, dtype=torch.float64, seed=1):
    """A depthwise conv's weight (3 H d, 1, taps) and a history (B, taps - 1, 3 H d)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(3 * heads * dim, 1, taps, generator=g, dtype=torch.float64) / taps
    history = torch.randn(batch, taps - 1, 3 * heads * dim, generator=g, dtype=torch.float64)
    return weight.to(dtype), history.to(dtype)


# (gates, conv): Mela's, Titans', and each alone
RULES = [("chunk", False), ("token", True), ("token", False), ("chunk", True)]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("heads,dim,chunk", [(2, 64, 16), (3, 24, 6), (1, 8, 2)])  # Mela 400m's head_dim; tiles
def test_the_kernel_equals_the_reference(rule, flags, heads, dim, chunk):  # padded; a chunk shorter than the conv
    gates, conv = rule
    qkv, logits, bias = draw(2, 4 * chunk, heads, dim, torch.float32)
    weight, history = draw_conv(2, heads, dim, dtype=torch.float32) if conv else (None, None)
    ours = chunk_inputs(qkv, logits, bias, heads, chunk, 0.01, FORGET_LOGIT_OFFSET, *flags, gates, weight, history)
    reference = chunk_inputs_reference(qkv.double(), logits.double(), bias.double(), heads, chunk, 0.01,
                                       FORGET_LOGIT_OFFSET, *flags, gates,
                                       *((weight.double(), history.double()) if conv else (None, None)))
    for name, a, b in zip(("q", "k", "v", "token weights", "decays"), ours, reference):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert torch.allclose(a.double(), b, rtol=1e-5, atol=1e-7), (name, (a.double() - b).abs().max().item())


def test_bf16_inputs_come_out_rounded_as_the_layer_keeps_them():
    qkv, logits, bias = draw(1, 32, 2, 16, torch.bfloat16)
    q, k, v, token_weights, decays = chunk_inputs(qkv, logits, bias, 2, 8, 0.01, FORGET_LOGIT_OFFSET)
    reference = chunk_inputs_reference(qkv, logits, bias, 2, 8, 0.01, FORGET_LOGIT_OFFSET)
    for ours, theirs in zip((q, k, v), reference):
        assert torch.equal(ours, ours.bfloat16().float())  # bf16 values in fp32
        assert torch.allclose(ours, theirs, atol=2 ** -7, rtol=2 ** -7)
    for ours, theirs in zip((token_weights, decays), reference[3:]):
        assert torch.allclose(ours, theirs, rtol=2e-2, atol=0)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("flags", FLAGS)
def test_the_backward_equals_autograd_through_the_reference_in_float64(rule, flags):
    gates, conv = rule
    leaves = [t.requires_grad_() for t in draw(2, 12, 2, 5) + (draw_conv(2, 2, 5) if conv else ())]
    options = (*flags, gates, *(leaves[3:] if conv else (None, None)))
    ours = chunk_inputs(*leaves[:3], 2, 4, 0.01, FORGET_LOGIT_OFFSET, *options)  # float64: the op runs the reference
    reference = chunk_inputs_reference(*leaves[:3], 2, 4, 0.01, FORGET_LOGIT_OFFSET, *options)
    g = torch.Generator().manual_seed(1)
    probes = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in reference]
    grads = torch.autograd.grad(sum((t * p).sum() for t, p in zip(ours, probes)), leaves)
    expected = torch.autograd.grad(sum((t * p).sum() for t, p in zip(reference, probes)), leaves, retain_graph=True)
    for name, a, b in zip(("qkv", "gate logits", "bias", "conv weight", "history"), grads, expected):
        assert b.abs().max() > 0, name
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), (name, (a - b).abs().max().item())
    # outputs left unused arrive in the backward as None: they count as zero
    q = chunk_inputs(*leaves[:3], 2, 4, 0.01, FORGET_LOGIT_OFFSET, *options)[0]
    only_q = torch.autograd.grad((q * probes[0]).sum(), leaves)
    expected_q = torch.autograd.grad((reference[0] * probes[0]).sum(), leaves, allow_unused=True, materialize_grads=True)
    for a, b in zip(only_q, expected_q):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("heads,dim,chunk", [(2, 16, 8), (3, 12, 3)])  # tiles padded; a chunk shorter than the conv
def test_the_backward_kernel_equals_autograd_through_the_reference(rule, flags, heads, dim, chunk):
    """fp32 inputs take the Triton backward (`chunk_inputs_bwd`); its gradients against autograd
    through the float64 reference."""
    gates, conv = rule
    drawn = draw(2, 4 * chunk, heads, dim) + (draw_conv(2, heads, dim) if conv else ())
    exact = [t.clone().requires_grad_() for t in drawn]
    leaves = [t.float().requires_grad_() for t in drawn]
    args = (heads, chunk, 0.01, FORGET_LOGIT_OFFSET, *flags, gates)
    ours = chunk_inputs(*leaves[:3], *args, *(leaves[3:] if conv else (None, None)))
    reference = chunk_inputs_reference(*exact[:3], *args, *(exact[3:] if conv else (None, None)))
    g = torch.Generator().manual_seed(1)
    probes = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in reference]
    grads = torch.autograd.grad(sum((t * p.float()).sum() for t, p in zip(ours, probes)), leaves)
    expected = torch.autograd.grad(sum((t * p).sum() for t, p in zip(reference, probes)), exact)
    for name, a, b in zip(("qkv", "gate logits", "bias", "conv weight", "history"), grads, expected):
        assert a.dtype == torch.float32 and b.abs().max() > 0, name
        error = (a.double() - b).abs().max() / b.abs().max()
        assert error < 1e-5, (name, error.item())


def test_mismatched_shapes_name_the_problem():
    qkv, logits, bias = draw(1, 10, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="multiple of the chunk"):
        chunk_inputs(qkv, logits, bias, 2, 4, 0.01, FORGET_LOGIT_OFFSET)
    with pytest.raises(ValueError, match=r"\(B, T, 3 H\)"):
        chunk_inputs(qkv, logits[..., :5], bias, 2, 5, 0.01, FORGET_LOGIT_OFFSET)
    qkv, logits, bias = draw(1, 8, 2, 4, torch.float32)
    weight, history = draw_conv(1, 2, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="both its weight and its history"):
        chunk_inputs(qkv, logits, bias, 2, 4, 0.01, FORGET_LOGIT_OFFSET, conv_weight=weight)
    with pytest.raises(ValueError, match=r"expected \(24, 1, K\)"):
        chunk_inputs(qkv, logits, bias, 2, 4, 0.01, FORGET_LOGIT_OFFSET, conv_weight=weight[:, :, :3], history=history)
    with pytest.raises(ValueError, match="gates 'scan' unknown"):
        chunk_inputs(qkv, logits, bias, 2, 4, 0.01, FORGET_LOGIT_OFFSET, gates="scan")


def mela_layer(whole_sequence=True, read_after_write=True):
    """Mela's memory at a width the interpreter runs in seconds (head_dim 8, hidden 16, chunk 4)."""
    cfg = mela_memory(whole_sequence=whole_sequence, expansion=2).filled_by(
        "test", dim=16, n_heads=2, head_dim=8, chunk_size=4, newton_schulz_steps=2, step_scale=1.0,
        read_after_write=read_after_write)
    torch.manual_seed(0)
    layer = NeuralMemory(cfg)
    with torch.no_grad():
        layer.to_gates.bias.normal_()  # a bias that matters (zeros at init)
    return layer


def run(layer, x, prepared: bool):
    """The layer's output, final weights and gradients, its inputs prepared by the op (where it
    applies) or by `write`; also how often the op ran."""
    calls = mock.Mock(wraps=neural_memory.chunk_inputs)
    with mock.patch.object(neural_memory, "chunk_inputs", calls):
        if prepared:
            y, state = layer(x)
        else:
            with mock.patch.object(NeuralMemory, "_prepares_inputs", lambda *a: False):
                y, state = layer(x)
    grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.shape[-1])).sum(), [x, *layer.parameters()])
    return y, state.weights, grads, calls.call_count


def test_the_layer_through_the_op_equals_its_own_preparation():
    layer = mela_layer()
    x = torch.randn(1, 12, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
    y, weights, grads, calls = run(layer, x, prepared=True)
    y_ref, weights_ref, grads_ref, calls_ref = run(layer, x, prepared=False)
    assert (calls, calls_ref) == (1, 0)
    for a, b in zip((y, *weights, *grads), (y_ref, *weights_ref, *grads_ref)):  # fp32 rounding through Newton-Schulz
        assert b.abs().max() > 0
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("case", ["diagnostics", "chunk loop", "partial chunk"])
def test_the_layer_prepares_its_own_inputs_where_the_op_does_not_apply(case):
    """Diagnostics read the per-token gates, the chunk loop takes no prepared input, a partial
    chunk waits in the state: each call runs `write`, as `_prepares_inputs` says."""
    layer = mela_layer(whole_sequence=case != "chunk loop", read_after_write=case != "partial chunk")
    x = torch.randn(1, 10 if case == "partial chunk" else 8, 16)
    _, _, _, calls = run(layer, x.requires_grad_(), prepared=True) if case != "diagnostics" else (None,) * 4
    if case == "diagnostics":
        counted = mock.Mock(wraps=neural_memory.chunk_inputs)
        with mock.patch.object(neural_memory, "chunk_inputs", counted), recording():
            layer(x)
        calls = counted.call_count
    assert calls == 0


def test_a_refused_call_projects_once_and_equals_the_unprepared_layer():
    """Where `_prepares_inputs` allows the op but the kernel refuses the call (here: forced), the
    layer writes through `write` from the projections it already made, their biases added: one
    projection per call, and the output and gradients of a layer that never tried the op."""
    layer = mela_layer()
    x = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    projections = mock.Mock(wraps=neural_memory.project_together)
    with mock.patch.object(neural_memory, "memory_inputs_refusal", lambda *a: "refused for the test"), \
            mock.patch.object(neural_memory, "project_together", projections):
        y, weights, grads, calls = run(layer, x, prepared=True)
    y_ref, weights_ref, grads_ref, _ = run(layer, x, prepared=False)
    assert (calls, projections.call_count) == (0, 1)
    for a, b in zip((y, *weights, *grads), (y_ref, *weights_ref, *grads_ref)):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def titans_layer():
    """Titans' memory (the per-token rule, a conv of 4, the surprise bound) on the whole-sequence
    path at a width the interpreter runs in seconds (head_dim 8, hidden 16, chunk 4)."""
    cfg = NeuralMemoryConfig(dim=16, n_heads=2, head_dim=8, expansion=2, chunk_size=4, whole_sequence=True)
    torch.manual_seed(0)
    layer = NeuralMemory(cfg)
    with torch.no_grad():
        layer.to_gates.bias.normal_()
    return layer


def run_calls(layer, parts, prepared: bool):
    """`parts` (each (1, T_i, 16)) written in consecutive calls, the state carried: the outputs, the final
    weights and conv history, the gradients to the inputs and the parameters, and how often the op ran."""
    calls = mock.Mock(wraps=neural_memory.chunk_inputs)
    with mock.patch.object(neural_memory, "chunk_inputs", calls), \
            mock.patch.object(NeuralMemory, "_prepares_inputs", NeuralMemory._prepares_inputs if prepared
                              else lambda *a: False):
        state, ys = None, []
        for x in parts:
            y, state = layer(x, state)
            ys.append(y)
    y = torch.cat(ys, 1)
    grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.shape[-1])).sum(), [*parts, *layer.parameters()])
    return y, (*state.weights, state.conv), grads, calls.call_count


def test_titans_memory_through_the_op_equals_its_own_preparation_across_calls():
    """The conv's history enters the next call's first chunk: two calls through the op give the
    outputs, fast weights, history and gradients of the layer's own `write`."""
    layer = titans_layer()
    g = torch.Generator().manual_seed(4)
    parts = [torch.randn(1, 8, 16, generator=g, requires_grad=True), torch.randn(1, 4, 16, generator=g,
                                                                              requires_grad=True)]
    y, state, grads, calls = run_calls(layer, parts, prepared=True)
    y_ref, state_ref, grads_ref, calls_ref = run_calls(layer, parts, prepared=False)
    assert (calls, calls_ref) == (2, 0)
    for a, b in zip((y, *state, *grads), (y_ref, *state_ref, *grads_ref)):
        assert b.abs().max() > 0
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), ((a - b).abs().max() / b.abs().max()).item()


def test_the_ops_launch_nothing_besides_their_kernels(monkeypatch):
    """A launch count takes the op and its backward's op for one launch each (torchtitan_ext/step_cost):
    for the fp32 contiguous tensors the layer hands them their bodies run no copy besides the kernel
    (`op_copies.copies_run`; the Triton kernels stubbed out)."""
    import kernels.memory_inputs as memory_inputs
    from op_copies import copies_run, unrun_kernels

    monkeypatch.setattr(memory_inputs, "_kernels", unrun_kernels("chunk_inputs_fwd", "chunk_inputs_bwd"))
    qkv, logits, bias = draw(2, 16, 2, 8, torch.float32)
    weight, history = draw_conv(2, 2, 8, dtype=torch.float32)
    options = (2, 4, 0.01, FORGET_LOGIT_OFFSET, True, True, True, True, "token")
    outputs, forward = copies_run(memory_inputs._op._init_fn, qkv, logits, None, *options, weight, history)
    _, backward = copies_run(memory_inputs._grads_op._init_fn, qkv, logits, None, weight, history,
                             *(torch.ones_like(t) for t in outputs), *options)
    assert (forward, backward) == (0, 0)
