"""torch.compile (fullgraph, as torchtitan compiles each block, through aot_eager; and by
regions, as Titans training compiles: `compile_regions`, the chunk steps through Inductor)
and activation checkpointing give the eager block's outputs and gradients, for every Titans
variant."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from models.lms.titans import TitansBlock, TitansConfig, TitansLM, VARIANTS
from models.memory.neural_memory import NeuralMemoryConfig, use_whole_sequence
from torchtitan_ext.families.titans import COMPILED_REGIONS, compile_regions


def small_config(variant: str) -> TitansConfig:
    return TitansConfig(variant=variant, vocab_size=10, dim=16, n_layers=1, n_heads=2, window=8, n_persistent=2,
                        memory=NeuralMemoryConfig(chunk_size=4, expansion=2))


def block_and_input(variant: str):
    torch.manual_seed(0)
    return TitansBlock(small_config(variant)), torch.randn(2, 16, 16, requires_grad=True)


def outputs_and_grads(block, x, run):
    block.zero_grad()
    x.grad = None
    out = run(x)
    out.square().sum().backward()
    return [out.detach(), x.grad.clone()] + [p.grad.clone() for p in block.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_compiled_block_matches_eager(variant):
    """The whole block in one graph (fullgraph: dynamo and AOTAutograd, the chunk loop
    unrolled) through aot_eager: Titans training compiles by regions instead, whose Inductor
    code the next test checks; Inductor on the whole block took 3.3 minutes of this suite."""
    block, x = block_and_input(variant)
    eager = outputs_and_grads(block, x, block)
    compiled = outputs_and_grads(block, x, torch.compile(block, fullgraph=True, backend="aot_eager"))
    for a, b in zip(eager, compiled):  # fp32 rounding: tolerance relative to each tensor's scale
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * max(1.0, a.abs().max().item()))


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_regionally_compiled_block_matches_eager(variant):
    """Regions through aot_eager (fast), the memory's chunk steps through Inductor."""
    torch.manual_seed(0)
    model, x = TitansLM(small_config(variant)), torch.randn(2, 16, 16, requires_grad=True)
    block = model.layers["0"]
    eager = outputs_and_grads(block, x, block)
    compile_regions(model, "aot_eager")
    compiled_regions = [name for name in COMPILED_REGIONS if getattr(getattr(block, name, None), "_compiled_call_impl", None)]
    assert block.memory.cfg.compiled_chunk_step and compiled_regions == [n for n in COMPILED_REGIONS if hasattr(block, n)]
    compiled = outputs_and_grads(block, x, block)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * max(1.0, a.abs().max().item()))


@pytest.mark.parametrize("variant", ["mac"])  # MAC: segments, retrieve and write in one graph (the others are simpler)
def test_whole_sequence_block_compiles_whole_and_matches_eager(variant):
    """With the memory on the whole-sequence kernels (TRITON_INTERPRET=1 on CPU), `compile_regions`
    compiles the block whole (fullgraph, the kernels opaque custom ops; aot_eager here) and it
    gives the eager chunk loop's outputs and gradients."""
    torch.manual_seed(0)
    model, x = TitansLM(small_config(variant)), torch.randn(2, 16, 16, requires_grad=True)
    block = model.layers["0"]
    eager = outputs_and_grads(block, x, block)
    assert use_whole_sequence(model) == 1
    compile_regions(model, "aot_eager")
    assert block._compiled_call_impl is not None and not block.memory.cfg.compiled_chunk_step
    compiled = outputs_and_grads(block, x, block)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * max(1.0, a.abs().max().item()))


@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpointed_block_matches_eager(variant):
    block, x = block_and_input(variant)
    eager = outputs_and_grads(block, x, block)
    recomputed = outputs_and_grads(block, x, lambda t: checkpoint(block, t, use_reentrant=False))
    for a, b in zip(eager, recomputed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("gates, ns_steps", [("token", 0), ("chunk", 5)], ids=["token_rule", "newton_schulz"])
def test_the_compiled_chunk_step_holds_nothing_aotautograds_cache_refuses(gates, ns_steps, monkeypatch):
    """A compiled run's chunk step must be a graph AOTAutograd's cache stores, or every launch
    traces and partitions it again: with the fp32 update's autocast switch on while no autocast
    was (`kernels.token_step.full_precision`) and the write's SiLU backward as a custom
    autograd.Function (`chunk_write.silu_backward`), titans_mac_debug's 6 compiled steps took
    31.6 s with a warm cache, 18.1 s without them. fp32, no autocast (under bf16 autocast the
    switch is needed, and stays): nothing in the step's graphs is refused."""
    from compile_checks import cache_checked
    from kernels import bounded_compile
    from models.memory import chunk_loop
    from models.memory.neural_memory import NeuralMemory

    refusals, graphs = [], []
    checked = cache_checked("aot_eager", refusals)

    def noting(gm, example_inputs):
        graphs.append(gm)
        return checked(gm, example_inputs)

    compiled = bounded_compile(chunk_loop.chunk_step, backend=noting)
    monkeypatch.setattr(chunk_loop, "compiled_chunk_step", lambda: compiled)
    torch.manual_seed(0)
    memory = NeuralMemory(NeuralMemoryConfig(dim=16, n_heads=2, head_dim=8, chunk_size=4, gates=gates,
                                             newton_schulz_steps=ns_steps, compiled_chunk_step=True))
    x = torch.randn(2, 12, 16, requires_grad=True)
    memory(x)[0].square().mean().backward()
    assert graphs and x.grad is not None
    assert refusals == []
