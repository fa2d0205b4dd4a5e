"""Benchmark: the Titans memory layer: speed against titans-pytorch 0.5.5, bytes kept for
backward per token at the paper flavors' shapes, and ops dispatched per chunk.

speed: forward + backward of one memory layer, B=4, T=2048, dim 256, 4 heads of 64, depth-2
    MLP memory (expansion 4), momentum on, chunk 64 and chunk 16, ours (default options:
    per-token gates, conv, output norm + gate; and `gates="chunk"`) eager and with each chunk
    step compiled (compiled once per shape, outside the timing) vs titans-pytorch in the same
    process. Ours updates chunk after chunk (each chunk's gradients at the state after the
    previous chunk); titans-pytorch takes every gradient at the sequence-start weights (less
    sequential work). Also our FLOP/s against this machine's fp32 matmul FLOP/s measured now.
    Everything is measured twice: under glibc malloc's default thresholds, then after
    `torchtitan_ext.allocator.keep_freed_memory` (freed blocks stay in the heap, as with
    jemalloc / tcmalloc): the peer's time at small chunks is mostly page faults under the first.
    The setting cannot be undone, so the sections after it run with freed memory kept (they
    count profiler-recorded bytes and dispatched ops, which it does not change).
bytes: bytes a forward leaves allocated for backward (net allocations recorded by the
    profiler, the output excepted) per token of one memory layer at the 170m / 400m / 760m shapes (chunk 64),
    measured on CPU in fp32 at B=1, T=1024 and extrapolated linearly to the paper's B=8,
    T=4096 per layer and for all layers; without recompute, with `checkpoint_chunks` (recompute
    groups of G chunks in backward) and with the fused chunk step (`kernel_backend="fused_torch"`:
    each step recomputed inside its own backward), and their time cost at the speed configuration.
ops: aten ops dispatched per chunk step (forward, backward), eager and compiled, taken as
    the difference between 16 and 8 chunks (per-call work cancels out). On a GPU each is
    a kernel launch.

    pip install -e .[bench] && python scripts/bench_memory.py [--only speed,bytes,ops] [--repeats 3] [--quick]

--quick runs every section on sequences of 256 tokens (speed, bytes, recompute): a check that
the whole benchmark runs, its compiled chunk step meeting the same shapes (batch, heads,
chunk, widths) as the full run, not figures to quote.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import torch
import torch._inductor.config
from torch.utils._python_dispatch import TorchDispatchMode

from models.memory.neural_memory import NeuralMemory, NeuralMemoryConfig
from torchtitan_ext.allocator import keep_freed_memory
from torchtitan_ext.families import titans
from torchtitan_ext.timing import median_seconds
from torchtitan_ext.training.cpu import measured_matmul_flops

B, T, DIM, HEADS, HEAD_DIM, EXPANSION = 4, 2048, 256, 4, 64, 4
FLAVOR_LENGTH = 1024  # tokens per sequence of the bytes measurement at the paper flavors' shapes
QUICK_LENGTH = 256  # --quick: tokens per sequence in every section
PARTS = ("speed", "bytes", "ops")
ALLOCATORS = ("default", "kept")  # glibc malloc's default thresholds; freed memory kept (`keep_freed_memory`)


def forward_backward(memory: torch.nn.Module, batch: int = B, length: int = T, dim: int = DIM):
    """A callable running one fwd+bwd of a memory layer that returns (output, state)."""
    x = torch.randn(batch, length, dim)

    def step():
        memory.zero_grad()
        y, _ = memory(x)
        y.sum().backward()

    return step


def bench_config(chunk: int, **options) -> NeuralMemoryConfig:
    return NeuralMemoryConfig(dim=DIM, n_heads=HEADS, head_dim=HEAD_DIM, depth=2, expansion=EXPANSION,
                              chunk_size=chunk, momentum=True, **options)


def theirs(chunk: int, length: int):
    from titans_pytorch import MemoryMLP
    from titans_pytorch import NeuralMemory as PeerMemory

    return forward_backward(PeerMemory(dim=DIM, chunk_size=chunk, heads=HEADS, dim_head=HEAD_DIM,
                                       model=MemoryMLP(HEAD_DIM, depth=2, expansion_factor=EXPANSION), momentum=True),
                           length=length)


def model_flops(gates: str, length: int) -> float:
    """Forward: per (batch, head) and token, the memory MLP runs on q and k (2 x 4 d^2 e),
    its explicit gradient costs 6 d^2 e (x 1.5 for the per-token rule: the two weighted
    sums double the 4 d^2 e of outer products); q, k, v, out projections 4 x 2 dim^2.
    Forward + backward = 3 x forward."""
    gradient = 6 if gates == "chunk" else 10
    memory = B * HEADS * length * (8 + gradient) * HEAD_DIM**2 * EXPANSION
    projections = 4 * 2 * B * length * DIM * HEADS * HEAD_DIM
    return 3 * (memory + projections)


def speed(repeats: int, length: int = T) -> None:
    try:
        import titans_pytorch  # noqa: F401
    except ImportError:
        print("speed: skipped: titans-pytorch is not installed (pip install -e .[bench], or EXTRAS=bench bash "
              "scripts/setup.sh)")
        return
    peak = measured_matmul_flops()
    print(f"B={B} T={length}; fp32 matmul peak (2048^3, measured now): {peak / 1e9:.1f} GFLOP/s; "
          f"threads {torch.get_num_threads()}")
    print(f"{'malloc':>7} {'chunk':>5} {'gates':>6} {'path':>9} {'ours s':>8} {'titans-pytorch s':>17} "
          f"{'speed-up':>9} {'ours GFLOP/s':>13} {'of peak':>8}")
    for allocator in ALLOCATORS:
        if allocator == "kept" and not keep_freed_memory():
            print("speed: malloc thresholds left as they are (the C library is not glibc): one setting only")
            break
        for chunk in (64, 16):
            peer = median_seconds(theirs(chunk, length), max(1, repeats - 1))
            for gates in ("token", "chunk"):
                for path, compiled in (("eager", False), ("compiled", True)):
                    memory = NeuralMemory(bench_config(chunk, gates=gates, compiled_chunk_step=compiled))
                    mine = median_seconds(forward_backward(memory, length=length), repeats)
                    achieved = model_flops(gates, length) / mine
                    print(f"{allocator:>7} {chunk:>5} {gates:>6} {path:>9} {mine:>8.3f} {peer:>17.3f} "
                          f"{peer / mine:>8.1f}x {achieved / 1e9:>13.1f} {achieved / peak:>7.1%}")


def saved_bytes(memory: NeuralMemory, batch: int, length: int) -> int:
    """Bytes one forward leaves allocated, its output excepted: what autograd keeps for
    backward (recompute closures included) plus the final state (a constant per call).
    Net CPU allocations (allocations minus frees) recorded by the profiler."""
    x = torch.randn(batch, length, memory.cfg.dim)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        y, _ = memory(x)
    return sum(e.self_cpu_memory_usage for e in profile.events()) - y.untyped_storage().nbytes()


def flavor_memory_config(flavor: str, **options) -> tuple[NeuralMemoryConfig, int]:
    """(memory config, number of layers) of a Titans paper flavor."""
    spec = titans.model_config(flavor, variant="mac")
    return dataclasses.replace(spec.block_memory, **options), spec.n_layers


def saved_bytes_per_token(flavor: str, length: int = FLAVOR_LENGTH, **options) -> float:
    cfg, _ = flavor_memory_config(flavor, **options)
    torch.manual_seed(0)
    return saved_bytes(NeuralMemory(cfg), 1, length) / length


# what backward recomputes: nothing ("none"), groups of 4 chunks (`checkpoint_chunks`), or each
# chunk step inside its fused backward (kernels/token_step.py's torch reference, which keeps
# only the step's inputs; the Triton kernels keep the same)
RECOMPUTE = {"none": {"checkpoint_chunks": 0}, "G=4": {"checkpoint_chunks": 4},
             "fused": {"checkpoint_chunks": 0, "kernel_backend": "fused_torch"}}


def bytes_report(repeats: int, flavor_length: int = FLAVOR_LENGTH, length: int = T) -> None:
    tokens = 8 * 4096
    print(f"bytes kept for backward per token per memory layer (fp32, chunk 64, measured at B=1 T={flavor_length}; "
          f"x {tokens} tokens = B 8 x T 4096)")
    print(f"{'flavor':>6} {'recompute':>10} {'bytes/token':>12} {'per layer GiB':>14} {'all layers GiB':>15}")
    for flavor in ("170m", "400m", "760m"):
        _, layers = flavor_memory_config(flavor)
        for label, options in RECOMPUTE.items():
            per_token = saved_bytes_per_token(flavor, flavor_length, **options)
            print(f"{flavor:>6} {label:>10} {per_token:>12,.0f} {per_token * tokens / 2**30:>14.2f} "
                  f"{per_token * tokens * layers / 2**30:>15.1f}")
    print(f"recompute cost at the speed configuration (B={B} T={length}, chunk 64, eager fwd+bwd):")
    for label, options in {**RECOMPUTE, "G=8": {"checkpoint_chunks": 8}}.items():
        memory = NeuralMemory(bench_config(64, **options))
        kept = saved_bytes(memory, B, length) / (B * length)
        print(f"  {label}: {median_seconds(forward_backward(memory, length=length), repeats):.3f} s, "
              f"{kept:,.0f} bytes/token")


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, views excepted (each other op is a
    kernel launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def compiled_kernel_count(run) -> int:
    """Kernels a compiled run launches: Inductor's fused kernels (profiled by name) and the
    matmuls it hands to aten."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    return sum("cpp_fused" in e.name or e.name in MATMULS for e in profile.events())


MATMULS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


def ops_per_chunk(cfg: NeuralMemoryConfig) -> tuple[float, float]:
    """(forward, backward) ops per chunk of one memory layer: dispatched non-view aten ops
    (eager) or launched kernels (compiled)."""
    memory = NeuralMemory(cfg)
    counts = []
    for chunks in (8, 16):
        x = torch.randn(1, chunks * cfg.chunk_size, cfg.dim)
        forward_backward(memory, 1, chunks * cfg.chunk_size, cfg.dim)()  # compile / warm up outside the count
        memory.zero_grad()
        outputs = []
        if cfg.compiled_chunk_step:
            forward = compiled_kernel_count(lambda: outputs.append(memory(x)[0]))
            backward = compiled_kernel_count(lambda: outputs[0].sum().backward())
        else:
            with OpCounter() as forward_counter:
                y, _ = memory(x)
            with OpCounter() as backward_counter:
                y.sum().backward()
            forward, backward = forward_counter.count, backward_counter.count
        counts.append((forward, backward))
    (f8, b8), (f16, b16) = counts
    return (f16 - f8) / 8, (b16 - b8) / 8


def ops_report(repeats: int) -> None:
    torch._inductor.config.cpp.enable_kernel_profile = True  # names Inductor's kernels in the profiler
    print("ops per chunk step (chunk 16, the speed configuration's widths; eager: non-view aten ops, "
          "compiled: launched kernels)")
    print(f"{'gates':>6} {'path':>9} {'forward':>8} {'backward':>9}")
    for gates in ("token", "chunk"):
        for path, compiled in (("eager", False), ("compiled", True)):
            forward, backward = ops_per_chunk(bench_config(16, gates=gates, compiled_chunk_step=compiled))
            print(f"{gates:>6} {path:>9} {forward:>8.0f} {backward:>9.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    parser.add_argument("--quick", action="store_true",
                        help=f"sequences of {QUICK_LENGTH} tokens in every section: checks that the benchmark runs "
                             "(same compiled shapes as the full run); its figures are not the documented ones")
    args = parser.parse_args(argv)
    parts = args.only.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.exit(2, f"error: unknown part(s) {unknown}: choose from {PARTS}\n")
    torch.set_flush_denormal(True)  # as the CPU training path does (torchtitan_ext/training/cpu.py)
    torch.manual_seed(0)
    reports = {"speed": speed, "bytes": bytes_report, "ops": ops_report}
    lengths = {"speed": dict(length=QUICK_LENGTH), "bytes": dict(flavor_length=QUICK_LENGTH, length=QUICK_LENGTH)}
    for part in PARTS:
        if part in parts:
            reports[part](args.repeats, **(lengths.get(part, {}) if args.quick else {}))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
