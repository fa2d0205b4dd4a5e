"""The whole-sequence memory kernels on one device: equal to the torch reference, and their time
against the chunk loop, per write rule.

    python scripts/bench_whole_sequence.py [--rules token,newton_schulz] [--batch 2] [--heads 16]
        [--seq-len 4096] [--chunk 64] [--head-dim 64] [--hidden 256] [--steps 5] [--json]
    TRITON_INTERPRET=1 python scripts/bench_whole_sequence.py --device cpu --dry-run   # tiny, CPU

For each rule ("token": Titans' per-token rule; "newton_schulz": Mela's chunk rule with 5 NS
steps, each chunk reading its own write):
- check: `kernels.whole_sequence_memory` against `whole_sequence_reference` in float64 on the
  same device, 4 chunks at the given widths with the options the rule's 400m layer runs
  (`CHECKED`: the per-token rule with the surprise bound, limits from 1e-3 to 10 so that some
  chunks clip, and the state kept every 2nd chunk; Newton-Schulz reading its own write): the
  largest error of the reads, the final state and every input's gradient, relative to the
  reference's largest magnitude. fp32 inputs and products: pass below 1e-5 (the tolerance of
  tests/test_whole_sequence.py). bf16 inputs and products (what bf16 autocast runs; on the
  tensor cores where kernels/ptxas.py allows, after pointing Triton at a fixed ptxas if one is
  installed, else on the FMA units: the header and each JSON row say which): pass within twice
  the error of the torch reference itself under bf16 autocast on that device;
- time: one memory layer (`NeuralMemory`, dim = heads x head_dim) forward + backward at
  --seq-len, on the whole-sequence path and on the chunk loop, after one untimed step each
  (the kernels' compilation), bf16 autocast on CUDA: ms per step, tokens/s, the ratio.
`--json` prints one `JSON {...}` line per rule (scripts/gpu_session.py reads them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from kernels import ptxas
from kernels.whole_sequence import TENSOR_CORES, products, refusal, whole_sequence_memory, whole_sequence_reference
from models.memory.neural_memory import NeuralMemory, NeuralMemoryConfig

RULES = {"token": {}, "newton_schulz": {"gates": "chunk", "newton_schulz_steps": 5, "read_after_write": True}}
# what `check` runs per rule, as the rule's 400m layer does: (surprise bound, checkpoint_every)
CHECKED = {"token": (True, 2), "newton_schulz": (False, 1)}
TOLERANCE = 1e-5


def check(rule: str, device: torch.device, heads: int, chunk: int, dim: int, hidden: int,
          bf16: bool = False) -> tuple[float, float | None]:
    """(the kernels' largest relative error against the float64 reference, and with `bf16`
    that of the torch reference under bf16 autocast, else None) (module docstring)."""
    ns_steps = RULES[rule].get("newton_schulz_steps", 0)
    bounded, checkpoint_every = CHECKED[rule]
    g = torch.Generator(device="cpu").manual_seed(0)

    def draw(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(device)

    batch, chunks = 1, 4
    q, k = (F.normalize(draw(batch, heads, chunks, chunk, dim), dim=-1) for _ in range(2))
    v = draw(batch, heads, chunks, chunk, dim)
    weightings = 1 if ns_steps else 2
    token_weights = 0.01 * draw(batch, heads, chunks, chunk, weightings).abs() * (1 if ns_steps else -1)
    gates = draw(batch, heads, chunks, *((2,) if ns_steps else (2, 2))).sigmoid() * 0.9
    state = (draw(batch, heads, 2, dim, hidden, scale=dim ** -0.5), draw(batch, heads, 2, hidden, dim, scale=hidden ** -0.5))
    limit = 10 ** (4 * torch.rand(batch, heads, chunks, weightings, generator=g) - 3).to(device) if bounded else None
    options = dict(ns_steps=ns_steps, read_after_write=bool(RULES[rule].get("read_after_write")), limit=limit)
    inputs = [*state, *(t.to(torch.bfloat16) if bf16 else t for t in (q, k, v)), token_weights, gates]

    def kernels(state, *rest, **options):
        return whole_sequence_memory(state, *rest, checkpoint_every=checkpoint_every, bf16_products=bf16, **options)

    def autocast_reference(*args, **options):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return whole_sequence_reference(*args, **options)

    runs = [(kernels, None), (whole_sequence_reference, torch.float64)] + [(autocast_reference, torch.float32)] * bf16
    weights, results = None, []
    for fn, dtype in runs:
        leaves = [(t if dtype is None else t.to(dtype)).requires_grad_() for t in inputs]
        y, final = fn(tuple(leaves[:2]), *leaves[2:], **options)
        outputs = [y, *final]
        if weights is None:
            weights = [torch.randn(o.shape, generator=g).to(device) for o in outputs]
        loss = sum((o.float() * w).sum() for o, w in zip(outputs, weights))
        results.append([o.detach() for o in outputs] + list(torch.autograd.grad(loss, leaves)))

    def error(ours):
        return max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, results[1]))

    return error(results[0]), error(results[2]) if bf16 else None


def time_layer(rule: str, whole: bool, device: torch.device, batch: int, seq_len: int, heads: int, chunk: int,
               dim: int, hidden: int, steps: int) -> float:
    """Seconds per forward + backward of one memory layer."""
    torch.manual_seed(0)
    cfg = NeuralMemoryConfig(dim=heads * dim, n_heads=heads, head_dim=dim, expansion=hidden // dim, chunk_size=chunk,
                             whole_sequence=whole, **RULES[rule])
    layer = NeuralMemory(cfg).to(device)
    x = torch.randn(batch, seq_len, heads * dim, device=device, requires_grad=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            y, _ = layer(x)
        y.float().square().mean().backward()

    step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rules", default=",".join(RULES), help=f"comma-separated: {', '.join(RULES)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dry-run", action="store_true", help="tiny widths, 2 heads, seq 64, chunk 16, 1 step")
    p.add_argument("--json", action="store_true", help="one 'JSON {...}' line per rule")
    a = p.parse_args(argv)
    if a.dry_run:
        a.batch, a.heads, a.seq_len, a.chunk, a.head_dim, a.hidden, a.steps = 1, 2, 64, 16, 16, 32, 1
    rules = a.rules.split(",")
    if unknown := [r for r in rules if r not in RULES]:
        p.error(f"--rules: unknown {unknown}; choose from {', '.join(RULES)}")
    device = torch.device(a.device)
    probe = torch.zeros(1, 1, 1, a.chunk, a.head_dim, device=device)
    state = (torch.zeros(1, 1, 2, a.head_dim, a.hidden, device=device), torch.zeros(1, 1, 2, a.hidden, a.head_dim, device=device))
    if reason := refusal(state, probe, probe, probe, probe.new_zeros(1, 1, 1, a.chunk, 2),
                         probe.new_zeros(1, 1, 1, 2, 2), 0):
        print(f"bench_whole_sequence: the kernels cannot run here: {reason}", file=sys.stderr)
        return 2
    ptxas.use_fixed_ptxas(ptxas.arch_of(device))
    assembler = ptxas.triton_ptxas(ptxas.arch_of(device) or ptxas.HOPPER) if device.type == "cuda" else None
    instruction = "mma" if ptxas.tensor_core_mode() == "mma" else "wgmma"
    units = f"tensor cores ({instruction})" if products(True, device) == TENSOR_CORES else "FMA units"
    print(f"torch {torch.__version__}; {device}; batch {a.batch}, {a.heads} heads, seq {a.seq_len}, chunk {a.chunk}, "
          f"head_dim {a.head_dim}, hidden {a.hidden}; bf16 products on the {units}"
          f"{f' (ptxas {assembler})' if assembler else ''}")
    failed = False
    for rule in rules:
        error, _ = check(rule, device, a.heads, a.chunk, a.head_dim, a.hidden)
        bf16_error, autocast_error = check(rule, device, a.heads, a.chunk, a.head_dim, a.hidden, bf16=True)
        shape = (device, a.batch, a.seq_len, a.heads, a.chunk, a.head_dim, a.hidden, a.steps)
        whole, loop = (time_layer(rule, w, *shape) for w in (True, False))
        ok = error < TOLERANCE and bf16_error <= 2 * autocast_error
        failed |= not ok
        row = {"rule": rule, "bf16_product_units": units, "ptxas": assembler, "max_relative_error": error, "bf16_relative_error": bf16_error,
               "autocast_relative_error": autocast_error, "equal": ok, "whole_sequence_ms": 1e3 * whole,
               "chunk_loop_ms": 1e3 * loop, "speedup": loop / whole, "tokens_per_s": a.batch * a.seq_len / whole}
        print(f"{rule:<14} vs reference {error:.1e} fp32, {bf16_error:.1e} bf16 (torch under autocast "
              f"{autocast_error:.1e}) ({'equal' if ok else 'NOT equal'}); layer fwd+bwd "
              f"{row['whole_sequence_ms']:.1f} ms whole-sequence vs {row['chunk_loop_ms']:.1f} ms chunk loop "
              f"({row['speedup']:.2f}x)")
        if a.json:
            print("JSON " + json.dumps(row))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
