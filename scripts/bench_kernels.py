"""Benchmark: the memory-update kernels (Newton-Schulz, fused update step), forward + backward.

On CPU: the compiled torch path against the eager torch reference (ratio), and achieved
FLOP/s against this machine's fp32 matmul FLOP/s measured in the same run. On CUDA (when
present) also the Triton kernels against the torch reference: the per-matrix kernels and,
for Newton-Schulz, the blocked path (upper-triangular Gram blocks, any size). Shapes: the
fast weights of a depth-2 memory with head_dim 64, expansion 4: 16 matrices (batch 4 x 4
heads) of 64 x 256 and 256 x 64, 5 Newton-Schulz steps. Then one chunk of the per-token write
rule (kernels/token_step.py; depth 2, head_dim 64, hidden 256, chunk 16, batch 4 x 4 heads,
forward + backward): the memory's `chunk_step` against `kernels.token_chunk_step`'s "torch",
"fused_torch" and (on CUDA only: on CPU it would run in the interpreter, no speed) "triton".

    python scripts/bench_kernels.py [--repeats 20]
"""

import argparse

import torch


from kernels import BACKENDS, MEMORY_UPDATE_BACKENDS, memory_update, newton_schulz
from torchtitan_ext.timing import median_seconds
from torchtitan_ext.training.cpu import measured_matmul_flops

BATCH, STEPS = (4, 4), 5
SHAPES = [(64, 256), (256, 64)]


def newton_schulz_flops(rows: int, cols: int) -> float:
    """Forward FLOPs of one matrix: per step X X^T, A^2, (bA + cA^2) X with r = min side."""
    r, c = sorted((rows, cols))
    return STEPS * (2 * r * r * c + 2 * r**3 + 2 * r * r * c)


def cases(device: str):
    for rows, cols in SHAPES:
        g = torch.Generator().manual_seed(0)
        w, s, grad = (torch.randn(*BATCH, rows, cols, generator=g).to(device).requires_grad_() for _ in range(3))
        eta, alpha = (torch.rand(BATCH, generator=g).to(device).requires_grad_() for _ in range(2))

        def ns(backend, s=s):
            newton_schulz(s, STEPS, backend).sum().backward()

        def update(backend, w=w, s=s, grad=grad, eta=eta, alpha=alpha):
            new_w, new_s = memory_update(w, s, grad, eta, alpha, STEPS, backend)
            (new_w.sum() + new_s.sum()).backward()

        yield f"newton_schulz {rows}x{cols}", ns, rows, cols, BACKENDS
        yield f"memory_update {rows}x{cols}", update, rows, cols, MEMORY_UPDATE_BACKENDS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    peak = measured_matmul_flops(device=device)
    print(f"fp32 matmul peak on {device} (2048^3, measured now): {peak / 1e9:.1f} GFLOP/s")
    backends = ["torch", "compiled"] + (["triton", "triton_blocked"] if device == "cuda" else [])
    print(f"{'op (16 matrices)':<26}" + "".join(f"{b + ' ms':>18}" for b in backends) + f"{'compiled/eager':>16}{'GFLOP/s (best)':>16}{'of peak':>9}")
    for name, fn, rows, cols, supported in cases(device):
        ms = {b: 1e3 * median_seconds(lambda b=b: fn(b), args.repeats, device) for b in backends if b in supported}
        flops = 3 * newton_schulz_flops(rows, cols) * BATCH[0] * BATCH[1]  # forward + backward ~ 3x forward
        best = min(ms.values()) / 1e3
        print(f"{name:<26}" + "".join(f"{ms[b]:>18.3f}" if b in ms else f"{'-':>18}" for b in backends)
              + f"{ms['torch'] / ms['compiled']:>15.2f}x{flops / best / 1e9:>16.1f}{flops / best / peak:>8.1%}")

    token_step_rows(device, args.repeats)


def token_step_rows(device: str, repeats: int) -> None:
    """ms per forward + backward of one per-token chunk step, by backend (module docstring)."""
    from kernels import token_chunk_step
    from models.memory.chunk_write import chunk_gates
    from models.memory.chunk_loop import chunk_step, UpdateRule

    g = torch.Generator().manual_seed(0)
    dim, hidden, chunk = 64, 256, 16
    state = [(torch.randn(*BATCH, 2, i, o, generator=g) * i ** -0.5).to(device).requires_grad_()
             for i, o in ((dim, hidden), (hidden, dim))]
    q, k, v = (torch.randn(*BATCH, chunk, dim, generator=g).to(device).requires_grad_() for _ in range(3))
    gates = [torch.rand(*BATCH, 1, chunk, generator=g).to(device) for _ in range(3)]
    token_weights, mix = (t[:, :, 0].detach().requires_grad_() for t in chunk_gates(0.01 * gates[0], gates[1].log(),
                                                                                       (1 - 0.02 * gates[2]).log(), "token"))

    def run(backend):
        if backend == "chunk_step":
            y, new, _ = chunk_step(tuple(state), q, k, v, token_weights, mix, UpdateRule())
        else:
            y, new = token_chunk_step(tuple(state), q, k, v, token_weights, mix, backend=backend)
        (y.sum() + sum(n.sum() for n in new)).backward()

    backends = ["chunk_step", "torch", "fused_torch"] + (["triton"] if device == "cuda" else [])
    ms = {b: 1e3 * median_seconds(lambda b=b: run(b), repeats, device) for b in backends}
    print("token chunk step (16 x chunk 16, 64 x 256): " + ", ".join(f"{b} {t:.3f} ms" for b, t in ms.items()))


if __name__ == "__main__":
    main()
