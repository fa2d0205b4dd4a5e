"""torchtitan_ext/step_cost/inductor_launches.py: a compiled graph's launches read from the wrapper
Inductor writes with its GPU (Triton) scheduling, without a GPU; the launch twin's trip counts;
one memory step counted as its training compiles it, and step_cost's prediction at that count."""

from __future__ import annotations

import pytest
import torch

from torchtitan_ext.step_cost import inductor_launches
from torchtitan_ext.step_cost.inductor_launches import count_twin, counting_backend, launch_twin
from torchtitan_ext.step_cost.prediction import predict, report


def test_a_graph_counts_its_kernels_at_every_call_and_fuses_pointwise_runs():
    """Two runs of pointwise ops around a matmul: Inductor fuses each run into one Triton kernel
    and leaves the matmul to a library kernel; its backward has two matmuls (the gradients of both
    inputs). Every call counts, and nothing while counting is off."""
    state = inductor_launches._Counting()

    def f(x, w):
        return ((torch.sin(x) * 2 + 1) @ w).relu().square().sum(-1)

    compiled = torch.compile(f, backend=counting_backend(state), fullgraph=True)
    x, w = torch.randn(16, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    torch._dynamo.reset()
    compiled(x, w).sum().backward()  # compiles the forward and the backward graph
    assert state.count.graphs == 2 and state.count.total == 0
    state.counting = True
    compiled(x, w).sum().backward()
    once = state.count.launches.copy()
    assert once["extern mm"] == 3 and once["triton"] >= 2, once  # forward 1 mm, backward 2
    for _ in range(2):
        compiled(x, w).sum().backward()
    assert dict(state.count.launches) == {kind: 3 * n for kind, n in once.items()} and state.count.calls == 6
    torch.testing.assert_close(compiled(x, w), f(x, w))  # the graph runs eagerly: eager's values


def test_the_launch_twin_keeps_every_trip_count_at_width_32():
    _, cfg, length, factor = launch_twin("titans_mac", "400m", 4096)
    assert (cfg.dim, cfg.n_layers, factor) == (32, 19, 16)
    assert (length // cfg.window, length // cfg.memory.chunk_size) == (4096 // 512, 4096 // 64)
    _, cfg, length, factor = launch_twin("mela", "400m", 4096)
    assert (cfg.dim, cfg.memory_dim, cfg.n_layers, cfg.patch_size, cfg.chunk_size) == (32, 32, 36, 1, 64)
    assert length // cfg.chunk_tokens == 2 and length // cfg.patch_size == 4096 // 32  # decoder chunks, patches
    assert cfg.n_kv_heads == 1 and cfg.n_heads == 2  # grouped as the flavor groups (12 / 6)
    _, cfg, length, factor = launch_twin("transformer", "400m", 4096)
    assert (cfg.dim, cfg.n_layers, cfg.head_dim, length) == (32, 24, 16, 256)


@pytest.mark.slow
def test_a_mac_step_counts_each_segments_memory_kernels_and_sets_the_prediction():
    """titans_mac_debug on the whole-sequence path at 2 segments a block: every block's forward
    and backward graph run once, and each segment writes through one forward and one backward
    memory kernel; step_cost's prediction takes the step's launches from the count."""
    p = predict("titans_mac_debug", seq_len=128, mode="compiled", whole_sequence=True, inductor_launches=True)
    count, layers = p.inductor, 2
    segments = p.twin["seq_len"] // launch_twin("titans_mac", "debug", 128)[1].window
    assert segments == 2 and p.twin["factor"] == 4 and p.twin["depths"] == (2,)
    assert count.calls == 2 * layers and count.graphs == 2
    assert count.launches["op memory_kernels.whole_sequence_fwd"] == layers * segments
    assert count.launches["op memory_kernels.whole_sequence_bwd"] == layers * segments
    assert p.launches == p.cost.total.launches - p.cost.region_launches + count.total
    assert 0 < p.cost.region_launches < p.cost.total.launches  # the loss, embedding and optimizer run outside
    assert p.step_s == p.cost.step_s + (p.launches - p.cost.total.launches) * p.cost.hardware.launch_s
    assert f"{p.launches:,} launches a step" in report(p)


def test_a_deep_step_is_its_two_shallowest_twins_extrapolated():
    """count_compiled extrapolates from depths 1 and 2; every decoder layer runs the same graphs, so
    depth 3 counted directly is the same line (the Transformer++ twin: seconds a depth)."""
    (one, _), (two, _), (three, _) = (count_twin("transformer", "debug", depth, seq_len=256) for depth in (1, 2, 3))
    assert two.total > one.total and two.calls == one.calls + 2  # a layer's forward and backward graph
    assert dict(three.launches) == {kind: 2 * two.launches[kind] - one.launches[kind] for kind in two.launches}
