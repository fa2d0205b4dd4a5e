"""The memory benchmark's measurements (scripts/bench_memory.py) measure what they claim:
recomputing groups of chunks keeps fewer bytes, longer streams keep proportionally more,
and the op counter sees the per-chunk work."""

from __future__ import annotations

import pytest

from conftest import load_script
from models.memory.neural_memory import NeuralMemory, NeuralMemoryConfig

bench_memory = load_script("bench_memory")

SMALL = dict(dim=32, n_heads=2, head_dim=16, chunk_size=4)


def test_saved_bytes_grow_with_length_and_shrink_with_recompute():
    memory = NeuralMemory(NeuralMemoryConfig(**SMALL))
    short, long = bench_memory.saved_bytes(memory, 1, 64), bench_memory.saved_bytes(memory, 1, 256)
    assert 3 < long / short < 4.5  # linear in tokens, plus a constant final state
    recomputed = NeuralMemory(NeuralMemoryConfig(**SMALL, checkpoint_chunks=4))
    assert bench_memory.saved_bytes(recomputed, 1, 256) < 0.5 * long


def test_ops_per_chunk_counts_the_chunk_loop():
    token_forward, token_backward = bench_memory.ops_per_chunk(NeuralMemoryConfig(**SMALL))
    chunk_forward, _ = bench_memory.ops_per_chunk(NeuralMemoryConfig(**SMALL, gates="chunk"))
    # every chunk's ops are counted (a miscount of the loop gives 0), backward costing more than forward
    assert token_backward > token_forward > 10 and chunk_forward > 10


def test_unknown_part_is_one_line_error(capsys):
    with pytest.raises(SystemExit) as stop:
        bench_memory.main(["--only", "speed,warp"])
    assert stop.value.code == 2
    assert "unknown part(s) ['warp']" in capsys.readouterr().err
