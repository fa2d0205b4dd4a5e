"""Compile the whole-sequence memory kernels for an H100 (sm_90) without a GPU, and check that
each fits a block's shared memory.

    python scripts/compile_kernels.py [--head-dim 64 --hidden 256 --chunk 64] [--arch 90]
        [--only fwd,bwd] [--rules token,newton_schulz] [--products fp32,bf16]

Triton's own compiler (its bundled CUDA backend and ptxas) builds each kernel variant the
launch would build: the layer's rule (the per-token mix; Newton-Schulz, read after write),
fp32 or bf16 products, with the launch options of kernels/whole_sequence.py (blocks, warps,
num_stages=1). It prints the shared memory each needs against the card's per-block limit
(H100: 232,448 bytes, 227 KiB) and the compile time, and exits 1 if any does not fit or does not
compile: what a lease would otherwise find only at its first launch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import whole_sequence_triton  # noqa: E402
from kernels.whole_sequence import BF16_ON_DEVICE, MUON_COEFFICIENTS, _blocks  # noqa: E402

SHARED_LIMIT = {90: 232_448}  # opt-in shared memory per block, bytes
RULES = {"token": (0, False), "newton_schulz": (5, True)}  # (ns_steps, read_after_write)
INTEGERS = ("N", "G", "C", "D", "HD")


def compile_variant(kernel: str, rule: str, bf16: bool, dim: int, hidden: int, chunk: int, arch: int):
    """The compiled kernel (Triton's CompiledKernel) of one variant."""
    fn = getattr(whole_sequence_triton, f"whole_sequence_{kernel}")
    ns_steps, read_after_write = RULES[rule]
    a, b, c = MUON_COEFFICIENTS
    blocks = _blocks(dim, chunk, hidden)
    num_warps = blocks.pop("num_warps")
    constants = dict(K=1 if ns_steps else 2, NS_STEPS=ns_steps, A_COEF=a, B_COEF=b, C_COEF=c, RESIDUAL=False,
                     READ_AFTER_WRITE=read_after_write, BF16=BF16_ON_DEVICE if bf16 else 0, **blocks)
    signature = {name: "constexpr" if name in constants else "*fp32" if name.endswith("_ptr") else
                 "i32" if name in INTEGERS else "fp32" for name in fn.arg_names}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": 1})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT))
    p.add_argument("--only", default="fwd,bwd")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--products", default="fp32,bf16")
    a = p.parse_args(argv)
    limit = SHARED_LIMIT[a.arch]
    print(f"triton {triton.__version__}; sm_{a.arch}; head_dim {a.head_dim}, hidden {a.hidden}, chunk {a.chunk}; "
          f"shared memory limit {limit:,} B per block")
    failed = False
    for kernel in a.only.split(","):
        for rule in a.rules.split(","):
            for products in a.products.split(","):
                start = time.perf_counter()
                try:
                    compiled = compile_variant(kernel, rule, products == "bf16", a.head_dim, a.hidden, a.chunk, a.arch)
                    shared = compiled.metadata.shared
                    verdict = "fits" if shared <= limit else "DOES NOT FIT"
                    failed |= shared > limit
                    line = f"{shared:>9,} B shared, {verdict}"
                except Exception as e:  # a variant that does not compile is a finding, not a crash
                    failed = True
                    line = f"DOES NOT COMPILE: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                print(f"{kernel} {rule:<14} {products} products: {line} ({time.perf_counter() - start:.0f} s)",
                      flush=True)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
