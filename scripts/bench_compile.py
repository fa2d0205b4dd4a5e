"""Benchmark: how long torch.compile takes on one Titans block, as torchtitan compiles it in
training (each block on its own, `fullgraph=True`: torchtitan.distributed.compile.apply_compile),
against the sequence length at the paper flavors' chunking.

    python scripts/bench_compile.py [--variant mac] [--lengths 1024,4096] [--backends eager,aot_eager]
        [--chunk 64] [--checkpoint-chunks 4]

The paper flavors (torchtitan_ext/families/titans.py) write chunks of 64 tokens and recompute
groups of 4 chunks in backward. torch.compile unrolls the memory's chunk loop into the block's
graph, so a 4K sequence traces 64 chunk steps, and tracing grows with T / chunk. Tracing does
not depend on the width: the block here is 64 wide with 2 heads (400m: 1024 wide, 16 heads),
batch 1, fp32 on CPU. Backends: "eager" is dynamo alone, "aot_eager" adds AOTAutograd's joint
forward-backward tracing, "inductor" adds code generation (C++ on CPU; on a GPU, Triton, whose
time differs). Each row starts from an empty compile cache (`torch._dynamo.reset`) and reports
the first forward + backward (compilation included), the second one, the same block
uncompiled, and the largest difference between the compiled and uncompiled outputs.
"""

from __future__ import annotations

import argparse
import time

import torch

from models.lms.titans import TitansConfig, TitansLM, VARIANTS
from models.memory.neural_memory import NeuralMemoryConfig

WIDTH, HEADS = 64, 2


def block(variant: str, chunk: int, checkpoint_chunks: int) -> torch.nn.Module:
    """One block of a Titans LM with the paper flavors' window and persistent tokens."""
    cfg = TitansConfig(vocab_size=256, dim=WIDTH, n_layers=1, n_heads=HEADS, window=512, n_persistent=4,
                       max_seq_len=131072, variant=variant,
                       memory=NeuralMemoryConfig(chunk_size=chunk, checkpoint_chunks=checkpoint_chunks))
    return TitansLM(cfg).layers["0"]


def timed_step(module, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(seconds, output) of one forward + backward."""
    start = time.perf_counter()
    y = module(x)
    y.sum().backward()
    return time.perf_counter() - start, y.detach()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="mac", choices=VARIANTS)
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--backends", default="eager,aot_eager")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--checkpoint-chunks", type=int, default=4)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    layer = block(args.variant, args.chunk, args.checkpoint_chunks)
    print(f"Titans {args.variant} block, width {WIDTH}, {HEADS} heads, chunk {args.chunk}, checkpoint_chunks "
          f"{args.checkpoint_chunks}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'T':>6} {'chunks':>6} {'backend':>10} {'first step s':>13} {'second s':>9} {'uncompiled s':>13} "
          f"{'max |diff|':>11}")
    for length in (int(n) for n in args.lengths.split(",")):
        x = torch.randn(1, length, WIDTH, requires_grad=True)
        uncompiled, want = timed_step(layer, x)
        for backend in args.backends.split(","):
            torch._dynamo.reset()
            compiled = torch.compile(layer, fullgraph=True, backend=backend)
            (first, got), (second, _) = timed_step(compiled, x), timed_step(compiled, x)
            print(f"{length:>6} {length // args.chunk:>6} {backend:>10} {first:>13.1f} {second:>9.2f} {uncompiled:>13.2f} "
                  f"{(got - want).abs().max().item():>11.1e}", flush=True)


if __name__ == "__main__":
    main()
