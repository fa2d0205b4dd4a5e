"""The whole-sequence memory path (kernels/whole_sequence.py): the Triton kernels (under
TRITON_INTERPRET=1 on CPU, set by conftest.py) against the torch reference, its launches per
layer at two sequence lengths on the meta device, and the memory layer through it against
the chunk loop. Errors are measured per tensor as max |ours - reference| / max |reference|."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import REPO, load_script

from kernels.whole_sequence import refusal, saved_bytes, whole_sequence_memory, whole_sequence_reference
from models.layers.diagnostics import recording
from models.memory.neural_memory import NeuralMemory, NeuralMemoryConfig

NAMES = ("y", "new W_1", "new W_2", "d s1", "d s2", "dq", "dk", "dv", "d token_weights", "d gates")


def inputs(batch, heads, chunks, chunk, dim, hidden, ns_steps, seed=0, dtype=torch.float32):
    """(s1, s2, q, k, v, token_weights, gates) as a Titans / Mela layer makes them: unit q, k,
    token weights of the size theta gives, gates in (0, 1)."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=g)

    q = F.normalize(draw(batch, heads, chunks, chunk, dim), dim=-1)
    k = F.normalize(draw(batch, heads, chunks, chunk, dim), dim=-1)
    v = draw(batch, heads, chunks, chunk, dim)
    uniform = lambda *shape: torch.rand(*shape, generator=g)  # noqa: E731
    if ns_steps:
        token_weights = 0.02 * uniform(batch, heads, chunks, chunk, 1)
        gates = torch.stack([0.9 * uniform(batch, heads, chunks), 0.1 * uniform(batch, heads, chunks)], -1)
    else:
        token_weights = -0.02 * uniform(batch, heads, chunks, chunk, 2)
        gates = uniform(batch, heads, chunks, 2, 2) * torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    s1 = draw(batch, heads, 2, dim, hidden) * dim ** -0.5
    s2 = draw(batch, heads, 2, hidden, dim) * hidden ** -0.5
    return [t.to(dtype) for t in (s1, s2, q, k, v, token_weights, gates)]


def outputs_and_grads(fn, tensors, **options):
    """(y, final W_1 stack, final W_2 stack, then the gradients of every input) of
    sum(y r_y) + sum(s1' r_1) + sum(s2' r_2), the r fixed random fp32 draws."""
    tensors = [t.detach().requires_grad_() for t in tensors]
    s1, s2, *rest = tensors
    y, (n1, n2) = fn((s1, s2), *rest, **options)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(t.shape, generator=g).to(t.dtype) for t in (y, n1, n2)]
    loss = sum((t * w).sum() for t, w in zip((y, n1, n2), weights))
    return [y.detach(), n1.detach(), n2.detach(), *torch.autograd.grad(loss, tensors)]


def relative_errors(ours, reference):
    return {name: ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
            for name, a, b in zip(NAMES, ours, reference)}


def check_against_reference(shape, ns_steps, residual, read_after_write, tolerance, dtype=torch.float32,
                            checkpoint_every=1, bf16_products=False, limit=None):
    """The kernels against the float64 reference at `shape` (`inputs`): outputs, final state
    and every gradient; `limit` the surprise bound (B, H, N, K) or None."""
    tensors = inputs(*shape, ns_steps, dtype=dtype)
    options = dict(ns_steps=ns_steps, step_scale=0.7, residual=residual, read_after_write=read_after_write,
                   limit=limit)
    # the reference in float64 from the same (possibly bf16-rounded) inputs; the state stays fp32 in the kernels
    state, rest = tensors[:2], tensors[2:]
    ours = outputs_and_grads(whole_sequence_memory, [s.float() for s in state] + rest, checkpoint_every=checkpoint_every,
                             bf16_products=bf16_products, **options)
    reference = outputs_and_grads(whole_sequence_reference, [t.double() for t in tensors], **options)
    errors = relative_errors(ours, reference)
    assert max(errors.values()) < tolerance, errors


@pytest.mark.parametrize("ns_steps, residual, read_after_write", [(0, False, False), (5, False, True)],
                         ids=["titans_token_rule", "mela_newton_schulz"])
def test_whole_sequence_paper_shape_matches_reference(ns_steps, residual, read_after_write):
    """head_dim 64, hidden 256, chunk 64 (the shape the per-chunk kernel refuses), 2 chunks."""
    check_against_reference((1, 1, 2, 64, 64, 256), ns_steps, residual, read_after_write, 1e-5)


def test_whole_sequence_paper_shape_many_programs():
    """The paper shape with 8 programs (batch 2 x 4 heads), 2 chunks, the mix rule: every
    program's slice of the inputs, checkpoints, group buffers and gradients is its own (an
    offset wrong by one program would mix heads). About a minute under the interpreter."""
    check_against_reference((2, 4, 2, 64, 64, 256), 0, False, False, 1e-5)


def test_whole_sequence_paper_shape_64_chunks_do_not_drift():
    """The paper shape over 64 chunks (a 4,096-token sequence), one program, the mix rule: the
    reads of every chunk and the final state stay within 1e-5 of the float64 reference at the
    end of the chain (no drift of the fp32 state). Forward only, about 80 s under the
    interpreter: 8 programs x 64 chunks, forward and backward, would take about 35 minutes
    (1.3 s forward and 3 s backward per program and chunk), so the many-program test above
    takes 2 chunks and this one program. Denormals are kept, as on a GPU: other tests' CPU
    training paths flush them process-wide (torchtitan_ext/training/cpu.py), which moves the
    reference's tiny late reads by 3e-3 of their scale."""
    torch.set_flush_denormal(False)
    s1, s2, q, k, v, tw, gates = inputs(1, 1, 64, 64, 64, 256, 0)
    ours = whole_sequence_memory((s1, s2), q, k, v, tw, gates)
    exact = whole_sequence_reference((s1.double(), s2.double()), q, k, v, tw, gates)
    errors = relative_errors([ours[0], *ours[1]], [exact[0], *exact[1]])
    assert max(errors.values()) < 1e-5, errors
    last = (ours[0][:, :, -1].double() - exact[0][:, :, -1]).abs().max() / exact[0][:, :, -1].abs().max()
    assert last < 1e-5, last


@pytest.mark.parametrize("ns_steps, residual, read_after_write",
                         [(0, True, True), (5, True, False), (2, False, False), (0, False, True)])
def test_whole_sequence_odd_shapes_match_reference(ns_steps, residual, read_after_write):
    """Sizes that are no power of two and a hidden width over one block (masks, two blocks):
    batch 2, one head, 2 chunks of 12, head_dim 24, hidden 96."""
    check_against_reference((2, 1, 2, 12, 24, 96), ns_steps, residual, read_after_write, 1e-5)


@pytest.mark.parametrize("ns_steps", [0, 5])
def test_whole_sequence_other_hidden_blocks_and_warps_match_reference(ns_steps, monkeypatch):
    """A lease's overrides (WHOLE_SEQUENCE_HIDDEN_BLOCK, WHOLE_SEQUENCE_WARPS) change how the
    kernels walk the hidden width, not what they compute: blocks of 32 over a hidden width of 80
    (three blocks, the last partial) on 4 warps match the reference; a value outside the choices
    is one error naming them."""
    from kernels import whole_sequence

    monkeypatch.setenv(whole_sequence.HIDDEN_BLOCK_ENV, "32")
    monkeypatch.setenv(whole_sequence.WARPS_ENV, "4")
    assert whole_sequence._blocks(24, 12, 80)["BH"] == 32 and whole_sequence._blocks(64, 64, 256)["num_warps"] == 4
    check_against_reference((2, 1, 2, 12, 24, 80), ns_steps, False, ns_steps > 0, 1e-5)
    monkeypatch.setenv(whole_sequence.HIDDEN_BLOCK_ENV, "24")
    with pytest.raises(ValueError, match="WHOLE_SEQUENCE_HIDDEN_BLOCK='24': choose one of 16, 32, 64, 128"):
        whole_sequence._blocks(24, 12, 96)


@pytest.mark.parametrize("ns_steps, checkpoint_every", [(0, 2), (5, 3)])
def test_whole_sequence_checkpoint_stride_recomputes_exactly(ns_steps, checkpoint_every):
    """Keeping every 2nd (3rd) chunk's state, 5 chunks (the last group partial): the backward
    recomputes the states between and still matches the reference."""
    check_against_reference((1, 2, 5, 8, 16, 32), ns_steps, False, ns_steps > 0, 1e-5, checkpoint_every=checkpoint_every)


@pytest.mark.parametrize("ns_steps", [0, 5])
def test_whole_sequence_bf16_inputs(ns_steps):
    """q, k, v, token weights and gates in bf16 (the state fp32, the products fp32): within
    1e-2 of the float64 reference run from the same bf16 values (their gradients come back in
    bf16: 2-3e-3 of rounding; the reads and the state within 1e-6)."""
    check_against_reference((1, 2, 2, 16, 32, 64), ns_steps, False, ns_steps > 0, 1e-2, dtype=torch.bfloat16)


@pytest.mark.parametrize("ns_steps", [0, 5])
def test_whole_sequence_bf16_products_as_close_as_autocast(ns_steps):
    """Products from bf16 operands (what the layer runs under bf16 autocast) are as close to the
    float64 reference as the torch reference itself under bf16 autocast (the chunk loop's
    numerics there): within twice its error, on every output and gradient. Newton-Schulz
    amplifies bf16 rounding for both (errors of several percent), the mix rule about 1e-2."""
    tensors = inputs(1, 2, 2, 16, 32, 64, ns_steps, dtype=torch.bfloat16)
    options = dict(ns_steps=ns_steps, step_scale=0.7, residual=False, read_after_write=ns_steps > 0)
    exact = outputs_and_grads(whole_sequence_reference, [t.double() for t in tensors], **options)

    def autocast_reference(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return whole_sequence_reference(*args, **kwargs)

    ours = outputs_and_grads(whole_sequence_memory, [t.float() for t in tensors[:2]] + tensors[2:],
                             bf16_products=True, **options)
    autocast = outputs_and_grads(autocast_reference, [t.float() for t in tensors], **options)
    ours_error = max(relative_errors(ours, exact).values())
    autocast_error = max(relative_errors(autocast, exact).values())
    assert 1e-4 < ours_error <= 2 * autocast_error, (ours_error, autocast_error)


def test_whole_sequence_is_causal_across_chunks():
    """Changing chunk 2's keys and values changes no read of chunks 0-2 (they read the state
    before chunk 2's write) and changes chunk 3's."""
    s1, s2, q, k, v, tw, gates = inputs(1, 2, 4, 8, 16, 64, 0)
    y, _ = whole_sequence_memory((s1, s2), q, k, v, tw, gates)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 2] = F.normalize(torch.randn_like(k2[:, :, 2]), dim=-1)
    v2[:, :, 2] += 1
    y2, _ = whole_sequence_memory((s1, s2), q, k2, v2, tw, gates)
    assert torch.equal(y[:, :, :3], y2[:, :, :3])
    assert (y[:, :, 3] - y2[:, :, 3]).abs().max() > 1e-4


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched (on the meta device: what a GPU would launch, views included)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def step_ops(seq_len: int, whole_sequence: bool, **memory) -> collections.Counter:
    """The ops of one memory layer's forward and backward at the paper memory shape (head_dim 64,
    hidden 256, chunk 64), batch 2, on the meta device."""
    with torch.device("meta"):
        layer = NeuralMemory(NeuralMemoryConfig(dim=128, n_heads=2, head_dim=64, chunk_size=64,
                                                whole_sequence=whole_sequence, **{"max_update_norm": 0.0} | memory))
        x = torch.randn(2, seq_len, 128, requires_grad=True)
    with OpCounter() as counter:
        y, _ = layer(x)
        y.sum().backward()
    return counter.ops


@pytest.mark.parametrize("memory", [{"checkpoint_chunks": 4},
                                    {"gates": "chunk", "newton_schulz_steps": 5, "read_after_write": True}],
                         ids=["token_rule_checkpoint_4", "newton_schulz_rule"])
def test_whole_sequence_launches_do_not_grow_with_length(memory):
    """At T 2048 and 4096 (the paper's) a layer's training step dispatches the same ops, one
    forward and one backward kernel among them; the chunk loop's count doubles (the counter sees
    the difference)."""
    short, long = step_ops(2048, True, **memory), step_ops(4096, True, **memory)
    assert short == long
    assert short["memory_kernels.whole_sequence_fwd.default"] == short["memory_kernels.whole_sequence_bwd.default"] == 1
    loop_short, loop_long = sum(step_ops(2048, False, **memory).values()), sum(step_ops(4096, False, **memory).values())
    assert loop_long > 1.9 * loop_short > 10 * sum(short.values())


LAYERS = {"titans": {}, "mela": {"gates": "chunk", "newton_schulz_steps": 5, "read_after_write": True, "step_scale": 0.5},
          "chunk_rule_plain": {"gates": "chunk", "residual": True}}
# Measured over seeds 0-7 (2026-12-02, this test's shapes, an AVX-512 host): Mela's largest relative
# error against float64 is 0.97e-5 to 3.0e-5 on the chunk loop and 1.4e-5 to 3.1e-5 on the kernels,
# whichever is lower changing with the seed (whole / loop 0.68-1.93); Titans' 3e-7 to 5e-7, the
# kernels the lower on every seed (0.70-0.94).
ROUNDING_FLOOR = {"mela": 5e-5}


def layer_run(layer, x, segments):
    """Reads of x fed in `segments` calls (the state carried), and the gradients of every
    parameter of sum(y^2) + sum(final fast weights^2)."""
    state, ys = None, []
    for part in x.tensor_split(segments, 1):
        y, state = layer(part, state)
        ys.append(y)
    y = torch.cat(ys, 1)
    loss = y.square().sum() + sum(w.square().sum() for w in state.weights)
    return [y.detach(), *torch.autograd.grad(loss, list(layer.parameters()))]


@pytest.mark.parametrize("name", list(LAYERS))
def test_whole_sequence_layer_matches_chunk_loop(name):
    """The memory layer through the whole-sequence path against the chunk loop, both fp32,
    both measured against the chunk loop in float64: outputs and every parameter's gradient,
    fed in two segments (the Titans layer's 20 tokens leave a pending partial chunk between
    them). The kernels are at least as close to float64 as the loop, or, for Mela, inside the fp32
    floor that Newton-Schulz's five steps amplify rounding to on both paths (ROUNDING_FLOOR)."""
    torch.manual_seed(0)
    memory = LAYERS[name]
    layers = [NeuralMemory(NeuralMemoryConfig(dim=32, n_heads=2, head_dim=16, chunk_size=8, whole_sequence=whole,
                                              max_update_norm=0.0, **memory)) for whole in (False, True)]
    layers[1].load_state_dict(layers[0].state_dict())
    exact = NeuralMemory(layers[0].cfg).double()
    exact.load_state_dict(layers[0].state_dict())
    x = torch.randn(2, 16 if memory.get("read_after_write") else 20, 32)
    segments = 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the whole-sequence path must be taken, not fall back
        loop, whole = (layer_run(layer, x, segments) for layer in layers)
    truth = layer_run(exact, x.double(), segments)
    loop_error = max(relative_errors(loop, truth).values())
    whole_error = max(relative_errors(whole, truth).values())
    assert whole_error <= max(1.5 * loop_error, ROUNDING_FLOOR.get(name, 1e-6)), (whole_error, loop_error)


def test_whole_sequence_falls_back_with_reason():
    """A float64 state cannot take the kernels: the layer warns with the reason and runs the
    chunk loop, equal bit for bit to a layer without the option."""
    torch.manual_seed(0)
    layers = [NeuralMemory(NeuralMemoryConfig(dim=16, n_heads=2, head_dim=8, chunk_size=4, whole_sequence=w)).double()
              for w in (False, True)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(1, 8, 16, dtype=torch.float64)
    with pytest.warns(UserWarning, match="whole-sequence memory path not taken.*float32"):
        y_whole, _ = layers[1](x)
    assert torch.equal(y_whole, layers[0](x)[0])
    s1, s2, q, k, v, tw, gates = inputs(1, 1, 2, 8, 16, 32, 0)
    assert "depth 1" in refusal((s1,), q, k, v, tw, gates, 0)
    assert "gates has shape" in refusal((s1, s2), q, k, v, tw, gates[..., 0], 0)


@pytest.mark.parametrize("memory", [{"max_update_norm": 0.5}, {"gates": "chunk", "residual": True, "max_update_norm": 1.0}],
                         ids=["token_rule", "chunk_rule"])
def test_whole_sequence_layer_applies_the_surprise_bound_as_the_chunk_loop(memory):
    """A bound tight enough to clip some chunks' sums and not others (about a fifth to a third here):
    the whole-sequence layer takes the kernels (no fallback warning), clips the same share of
    sums as the chunk loop, and gives its outputs and gradients."""
    torch.manual_seed(0)
    layers = [NeuralMemory(NeuralMemoryConfig(dim=32, n_heads=2, head_dim=16, chunk_size=8, whole_sequence=whole,
                                              **memory)) for whole in (False, True)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = 3 * torch.randn(2, 32, 32)
    runs = []
    with recording(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for layer in layers:
            runs.append((layer_run(layer, x, 1), float(layer.last_stats["clipped_share"])))
    (loop, loop_share), (whole, whole_share) = runs
    assert 0 < loop_share < 1 and whole_share == loop_share
    assert max(relative_errors(whole, loop).values()) < 1e-4


def test_saved_bytes_count_the_checkpoints():
    """Bytes kept for backward grow with the kept states: one more chunk adds a state entry of
    2 matrices x [M; S] x d x h x 4 bytes and its inputs; a stride of 4 keeps a quarter of them."""
    one = saved_bytes(1, 1, 64, 64, 64, 256)
    two = saved_bytes(1, 1, 128, 64, 64, 256)
    entry, inputs_per_chunk = 2 * 2 * 64 * 256 * 4, 3 * 64 * 64 * 2 + 64 * 2 * 4 + 16
    assert two - one == entry + inputs_per_chunk
    every, strided = saved_bytes(1, 1, 4096, 64, 64, 256), saved_bytes(1, 1, 4096, 64, 64, 256, checkpoint_every=4)
    assert every - strided == (65 - 17) * entry


def test_bench_script_checks_and_times_on_the_interpreter(capsys):
    """scripts/bench_whole_sequence.py --dry-run (the lease's `kernels` section at tiny widths):
    the kernels equal the reference and both paths are timed."""
    bench = load_script("bench_whole_sequence")
    code = bench.main(["--device", "cpu", "--dry-run", "--json", "--rules", "token"])
    rows = [json.loads(line[5:]) for line in capsys.readouterr().out.splitlines() if line.startswith("JSON ")]
    assert code == 0 and len(rows) == 1
    assert rows[0]["equal"] and rows[0]["max_relative_error"] < 1e-5
    # bf16 inputs and products, beside the torch reference under bf16 autocast: rounding, not 0
    assert 1e-4 < rows[0]["bf16_relative_error"] <= 2 * rows[0]["autocast_relative_error"]
    assert rows[0]["whole_sequence_ms"] > 0 and rows[0]["chunk_loop_ms"] > 0


@pytest.mark.slow
def test_kernels_compile_for_an_h100_within_its_shared_memory_and_spill_bound():
    """scripts/compile_kernels.py builds kernels for sm_90 with Triton's bundled CUDA backend
    (no GPU; a process of its own, since this one's kernels are the interpreter's): the forward
    in fp32 products and the per-token backward in each bf16 form (on the FMA units, the
    fallback without a fixed ptxas; through wgmma, the Hopper default, and mma.sync) at the paper shape, and
    Titans' input kernels (kernels/memory_inputs_triton.py, which spill nothing under the pinned Triton), fit 227 KiB of shared memory and spill no more than the script's bound, read from ptxas's
    report (every variant: docs/benchmarks.md); the wgmma backward's HGMMAs have no register
    written while in flight (kernels/ptxas.py `wgmma_hazards`), and the other forms have none."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for only, products in (("fwd", "fp32"), ("bwd", "bf16_fma"), ("bwd", "bf16_wgmma"), ("bwd", "bf16_mma"),
                           ("inputs_fwd,inputs_bwd", "fp32")):  # the input kernels: no spill here, no HGMMA
        run = subprocess.run([sys.executable, "scripts/compile_kernels.py", "--only", only, "--rules", "token",
                              "--products", products, "--wgmma-hazards"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=900)
        assert run.returncode == 0 and "shared, fits" in run.stdout, run.stdout + run.stderr[-2000:]
        assert " registers, spill stores " in run.stdout and "OVER THE BOUND" not in run.stdout, run.stdout
        if only.startswith("inputs"):
            assert run.stdout.count("spill stores      0 B, loads      0 B") == 2, run.stdout
        # the wgmma backward's HGMMAs (the fp32 forward and the mma.sync backward have none), none written to
        # before its wait
        hgmma = int(run.stdout.split(" HGMMA,")[0].rsplit(" ", 1)[1])
        assert (hgmma > 0) == (products == "bf16_wgmma") and "0 writes to in-flight HGMMA registers" in run.stdout, run.stdout


@pytest.mark.parametrize("bounded", [False, True])
def test_the_ops_launch_nothing_besides_their_kernels(bounded, monkeypatch):
    """A launch count takes each whole-sequence op for one launch (torchtitan_ext/step_cost): their
    bodies run no copy besides the kernel (`op_copies.copies_run`; the Triton kernels stubbed out)
    for the fp32 contiguous state the layer hands them, forward and backward, with and without a
    surprise bound. (They once ran 4 forward and 2-3 backward: the state copied into and out of the
    checkpoints, the gradients and scales copied for the kernel.)"""
    from kernels import whole_sequence
    from op_copies import copies_run, unrun_kernels

    monkeypatch.setattr(whole_sequence, "_kernels", unrun_kernels("whole_sequence_fwd", "whole_sequence_bwd"))
    batch, heads, chunks, chunk, dim, hidden = 1, 2, 3, 4, 8, 16
    q, k, v = (torch.randn(batch, heads, chunks, chunk, dim) for _ in range(3))
    token_weights, gates = torch.randn(batch, heads, chunks, chunk, 2), torch.rand(batch, heads, chunks, 2, 2)
    s1, s2 = torch.randn(batch, heads, 2, dim, hidden), torch.randn(batch, heads, 2, hidden, dim)
    limit = torch.full((batch, heads, chunks, 2), 20.0) if bounded else None
    (y, f1, f2, ck1, ck2, scales), forward = copies_run(
        whole_sequence._forward_op._init_fn, q, k, v, token_weights, gates, s1, s2, 0, 1.0, False, False, 2, False,
        limit)
    _, backward = copies_run(whole_sequence._backward_op._init_fn, q, k, v, token_weights, gates, ck1, ck2, s1, s2, f1,
                             f2, torch.ones_like(y), torch.ones_like(f1), torch.ones_like(f2), 0, 1.0, False, False, 2,
                             False, limit, scales if bounded else None)
    assert (forward, backward) == (0, 0)
