"""Benchmark: the Titans memory layer, forward + backward, ours vs titans-pytorch 0.5.5.

Matched configuration: B=4, T=2048, dim 256, 4 heads of 64, depth-2 MLP memory with
expansion 4, momentum on; chunk 64 and chunk 16. Ours updates chunk after chunk (each
chunk's gradient against the state after the previous chunk); titans-pytorch takes every
chunk's gradient against the weights at the start of the sequence (less sequential work).
Ours runs twice: eager, and with each chunk step through torch.compile
(`compiled_chunk_step`, compiled once per shape; compilation is outside the timing).
Also reports our achieved FLOP/s against this machine's fp32 matmul FLOP/s measured in the
same run (analytic count: memory MLP forward/gradient per chunk + projections, x3 for
forward + backward).

    pip install -e .[bench] && python scripts/bench_memory.py [--repeats 3]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.neural_memory import NeuralMemory, NeuralMemoryConfig  # noqa: E402
from torchtitan_ext.cpu import measured_matmul_flops  # noqa: E402

B, T, DIM, HEADS, HEAD_DIM, EXPANSION = 4, 2048, 256, 4, 64, 4


def seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_backward(memory: torch.nn.Module):
    """A callable running one fwd+bwd of a memory layer that returns (output, state)."""
    x = torch.randn(B, T, DIM)

    def step():
        memory.zero_grad()
        y, _ = memory(x)
        y.sum().backward()

    return step


def ours(chunk: int, compiled: bool):
    return forward_backward(NeuralMemory(NeuralMemoryConfig(dim=DIM, n_heads=HEADS, head_dim=HEAD_DIM, depth=2,
                                                            expansion=EXPANSION, chunk_size=chunk, momentum=True,
                                                            compiled_chunk_step=compiled)))


def theirs(chunk: int):
    from titans_pytorch import MemoryMLP
    from titans_pytorch import NeuralMemory as PeerMemory

    return forward_backward(PeerMemory(dim=DIM, chunk_size=chunk, heads=HEADS, dim_head=HEAD_DIM,
                                       model=MemoryMLP(HEAD_DIM, depth=2, expansion_factor=EXPANSION), momentum=True))


def model_flops() -> float:
    """Forward: per (batch, head) and token, the memory MLP runs on q and k (2 x 4 d^2 e)
    and its explicit gradient costs 6 d^2 e; q, k, v, out projections 4 x 2 dim^2.
    Forward + backward = 3 x forward."""
    memory = B * HEADS * T * 14 * HEAD_DIM**2 * EXPANSION
    projections = 4 * 2 * B * T * DIM * HEADS * HEAD_DIM
    return 3 * (memory + projections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_flush_denormal(True)  # as the CPU training path does (torchtitan_ext/cpu.py)
    torch.manual_seed(0)
    peak = measured_matmul_flops()
    print(f"fp32 matmul peak (2048^3, measured now): {peak / 1e9:.1f} GFLOP/s; threads {torch.get_num_threads()}")
    print(f"{'chunk':>5} {'path':>9} {'ours s':>8} {'titans-pytorch s':>17} {'speed-up':>9} {'ours GFLOP/s':>13} {'of peak':>8}")
    for chunk in (64, 16):
        peer = seconds(theirs(chunk), max(1, args.repeats - 1))
        for path, compiled in (("eager", False), ("compiled", True)):
            mine = seconds(ours(chunk, compiled), args.repeats)
            achieved = model_flops() / mine
            print(f"{chunk:>5} {path:>9} {mine:>8.3f} {peer:>17.3f} {peer / mine:>8.1f}x {achieved / 1e9:>13.1f} "
                  f"{achieved / peak:>7.1%}")


if __name__ == "__main__":
    main()
