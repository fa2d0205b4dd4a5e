"""Benchmark: how long torch.compile takes on one Titans block against the sequence length at
the paper flavors' chunking, compiled two ways: "block", as torchtitan's `apply_compile`
compiles each block (whole, `fullgraph=True`), and "regional", as Titans training now does
(`torchtitan_ext.families.titans.compile_regions`: attention, gate and SwiGLU compiled each on
its own, the memory's chunk loop eager with each chunk step compiled), and "whole_sequence": the block
compiled whole (`fullgraph=True`) with its memory on the whole-sequence kernels
(`NeuralMemoryConfig.whole_sequence`: two custom ops the graph keeps opaque, so nothing unrolls; on
a CPU run the script with TRITON_INTERPRET=1; where the kernels cannot run, the fallback's warning
stops the script with its reason instead of timing the chunk loop).

    python scripts/bench_compile.py [--variant mac] [--lengths 1024,4096] [--backends eager,aot_eager]
        [--modes block,regional,whole_sequence] [--chunk 64] [--checkpoint-chunks 4] [--device meta]

The paper flavors (torchtitan_ext/families/titans.py) write chunks of 64 tokens and recompute
groups of 4 chunks in backward. torch.compile unrolls the memory's chunk loop into the block's
graph in "block" mode, so a 4K sequence traces 64 chunk steps, and tracing grows with
T / chunk; in "regional" mode it does not. Tracing does
not depend on the width: the block here is 64 wide with 2 heads (400m: 1024 wide, 16 heads),
batch 1, fp32 on CPU. Backends: "eager" is dynamo alone, "aot_eager" adds AOTAutograd's joint
forward-backward tracing, "inductor" adds code generation (C++ on CPU; on a GPU, Triton, whose
time differs); in "regional" mode the chunk steps compile with Inductor whatever the backend
(`compiled_chunk_step`). Each row starts from an empty compile cache (`torch._dynamo.reset`; Inductor's
on-disk cache is not cleared, so a repeated command reuses generated code) and reports
the first forward + backward (compilation included), the second one, the same block
uncompiled, and the largest difference between the compiled and uncompiled outputs.
`--device meta` (backends eager / aot_eager; modes block, whole_sequence) runs nothing but the tracing: the first step is
the compile time alone (dynamo + AOTAutograd, with the whole-sequence kernels' meta
implementations), free of the interpreter's run time on a CPU; there is nothing to compare.
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch

from models.lms.titans import TitansConfig, TitansLM, VARIANTS
from models.memory.neural_memory import NeuralMemoryConfig, use_whole_sequence
from torchtitan_ext.families.titans import compile_regions

WIDTH, HEADS = 64, 2


def one_block_lm(variant: str, chunk: int, checkpoint_chunks: int) -> TitansLM:
    """A one-block Titans LM with the paper flavors' window and persistent tokens."""
    cfg = TitansConfig(vocab_size=256, dim=WIDTH, n_layers=1, n_heads=HEADS, window=512, n_persistent=4,
                       max_seq_len=131072, variant=variant,
                       memory=NeuralMemoryConfig(chunk_size=chunk, checkpoint_chunks=checkpoint_chunks))
    return TitansLM(cfg)


def compiled_block(model: TitansLM, mode: str, backend: str) -> torch.nn.Module:
    """The model's block compiled in `mode` ("block", "regional" or "whole_sequence"), on a copy of the model."""
    model = copy.deepcopy(model)
    if mode == "whole_sequence":
        use_whole_sequence(model)
    if mode in ("block", "whole_sequence"):
        return torch.compile(model.layers["0"], fullgraph=True, backend=backend)
    compile_regions(model, backend)
    return model.layers["0"]


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
    parser.add_argument("--modes", default="block,regional", help="block, regional, whole_sequence")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--checkpoint-chunks", type=int, default=4)
    parser.add_argument("--device", default="cpu", choices=("cpu", "meta"))
    args = parser.parse_args(argv)
    if args.device == "meta" and ("inductor" in args.backends or "regional" in args.modes):
        parser.error("--device meta traces only: choose --backends eager and/or aot_eager, and modes block and/or "
                     "whole_sequence (regional compiles the chunk steps with Inductor)")
    warnings.filterwarnings("error", message="whole-sequence memory path not taken")
    torch.manual_seed(0)
    with torch.device(args.device):
        model = one_block_lm(args.variant, args.chunk, args.checkpoint_chunks)
    print(f"Titans {args.variant} block, width {WIDTH}, {HEADS} heads, chunk {args.chunk}, checkpoint_chunks "
          f"{args.checkpoint_chunks}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'T':>6} {'chunks':>6} {'mode':>8} {'backend':>10} {'first step s':>13} {'second s':>9} "
          f"{'uncompiled s':>13} {'max |diff|':>11}")
    for length in (int(n) for n in args.lengths.split(",")):
        x = torch.randn(1, length, WIDTH, requires_grad=True, device=args.device)
        uncompiled, want = timed_step(model.layers["0"], x)
        for mode in args.modes.split(","):
            for backend in args.backends.split(","):
                torch._dynamo.reset()
                compiled = compiled_block(model, mode, backend)
                (first, got), (second, _) = timed_step(compiled, x), timed_step(compiled, x)
                diff = "-" if args.device == "meta" else f"{(got - want).abs().max().item():.1e}"
                print(f"{length:>6} {length // args.chunk:>6} {mode:>8} {backend:>10} {first:>13.1f} {second:>9.2f} "
                      f"{uncompiled:>13.2f} {diff:>11}", flush=True)


if __name__ == "__main__":
    main()
