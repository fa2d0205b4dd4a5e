"""Compile the whole-sequence memory kernels for an H100 (sm_90) without a GPU, and check that
each fits a block's shared memory and does not spill registers beyond a bound.

    python scripts/compile_kernels.py [--head-dim 64 --hidden 256 --chunk 64] [--arch 90]
        [--only fwd,bwd,inputs_fwd,inputs_bwd] [--rules token,newton_schulz]
        [--products fp32,bf16_wgmma,bf16_mma,bf16_fma]
        [--max-spill BYTES]
        [--bound] [--wgmma-hazards]

Triton's own compiler (its bundled CUDA backend and ptxas) builds each kernel variant the
launch would build: the layer's rule (the per-token mix; Newton-Schulz, read after write),
fp32 products, bf16 products on the tensor cores through Hopper's wgmma (`bf16_wgmma`: the default
on Hopper with a ptxas >= 13.3, kernels/ptxas.py) or through mma.sync (`bf16_mma`:
WHOLE_SEQUENCE_TENSOR_CORES=mma, compiled with DISABLE_MMA_V3=1), or on the FMA units (`bf16_fma`, the
fallback), with the
launch options of kernels/whole_sequence.py (blocks, warps,
num_stages=1; WHOLE_SEQUENCE_HIDDEN_BLOCK and WHOLE_SEQUENCE_WARPS change them as they change a
launch; a wider block spills past the bound, which the run then reports by exiting 1). It prints
per variant the registers per thread and the spill stores / loads
(bytes per thread), read from ptxas's report (`ptxas -v` run again on the kernel's PTX: Triton
reads registers and spills only when it loads a kernel on a GPU), the shared memory each needs
against the card's per-block limit (H100: 232,448 bytes, 227 KiB) and the compile time. It exits 1
if any variant does not compile, does not fit, or spills more than its bound (stores or loads,
bytes per thread: MAX_SPILL_BYTES per products, or --max-spill for all): what a lease would
otherwise find only at its first launch. `--wgmma-hazards` also disassembles each kernel (Triton's
bundled nvdisasm) and counts its HGMMAs and the writes to a register of an in-flight one before
its wait (kernels/ptxas.py `wgmma_hazards`, the pattern of ptxas's fault before CUDA 13.3); any
such write fails the run too.

`inputs_fwd` / `inputs_bwd` are the kernels preparing the whole-sequence kernels' inputs
(kernels/memory_inputs_triton.py `chunk_inputs_fwd` / `_bwd`), compiled once per rule as the layer
launches them under bf16 autocast (bf16 projections and history, fp32 weights and outputs): "token"
as Titans' memory (the per-token rule after a conv of 4), "newton_schulz" as Mela's (the chunk rule, no
conv), with the launch's warps (kernels/memory_inputs.py `NUM_WARPS`); --products does not apply to
them (no products), and their spill bound is `INPUTS_MAX_SPILL_BYTES` (--max-spill overrides it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import memory_inputs_triton, whole_sequence_triton  # noqa: E402
from kernels.memory_inputs import NUM_WARPS as INPUTS_WARPS  # noqa: E402
from kernels.ptxas import wgmma_hazards  # noqa: E402
from kernels.whole_sequence import FMA_BF16, FP32, MUON_COEFFICIENTS, TENSOR_CORES, _blocks, without_wgmma  # noqa: E402

SHARED_LIMIT = {90: 232_448}  # opt-in shared memory per block, bytes
# Spill stores or loads per thread a variant may have, per products, at the paper shape (Triton
# 3.9, sm_90a, its ptxas 13.4), summed over the kernel and the functions it calls: the worst variant,
# rounded up (figures of 2026-12-04, after the kernels took the initial and final states' pointers).
# bf16 through wgmma (the default on Hopper, with a fixed ptxas): the Newton-Schulz backward's 1,136 B
# of loads with the surprise bound (--bound; 1,080 B without), the per-token backward 796 B (432 B), the
# forwards none. bf16 through mma.sync: the per-token backward's 1,180 B of loads with the bound, the
# Newton-Schulz backward 972 B. bf16 on the FMA units (operands rounded to bf16: the fallback without a
# fixed ptxas): the Newton-Schulz backward's 25,164 B (with the bound), the per-token backward 4,552 B.
# fp32: the Newton-Schulz backward's 40,060 B. Why not 0: kernels/whole_sequence_triton.py.
MAX_SPILL_BYTES = {"bf16_wgmma": 1_152, "bf16_mma": 1_280, "bf16_fma": 25_600, "fp32": 40_960}
# The input kernels (kernels/memory_inputs_triton.py) at 8 warps: 0 B under Triton 3.9 (its ptxas 13.4); 28 B of
# stores and loads in Mela's backward under the lease image's Triton 3.6 (its ptxas 12.8), 0 in the others (2026-12-04).
INPUTS_MAX_SPILL_BYTES = 32
# the kernels' BF16 switch per products; bf16_mma is the tensor-core switch compiled without wgmma
PRODUCTS = {"fp32": FP32, "bf16_wgmma": TENSOR_CORES, "bf16_mma": TENSOR_CORES, "bf16_fma": FMA_BF16}
RULES = {"token": (0, False), "newton_schulz": (5, True)}  # (ns_steps, read_after_write)
INTEGERS = ("N", "G", "C", "D", "HD")


def compile_variant(kernel: str, rule: str, products: str, dim: int, hidden: int, chunk: int, arch: int,
                    bound: bool = False):
    """The compiled kernel (Triton's CompiledKernel) of one variant (`products`: a PRODUCTS key;
    `bound`: with the surprise bound)."""
    fn = getattr(whole_sequence_triton, f"whole_sequence_{kernel}")
    ns_steps, read_after_write = RULES[rule]
    a, b, c = MUON_COEFFICIENTS
    blocks = _blocks(dim, chunk, hidden)
    num_warps = blocks.pop("num_warps")
    constants = dict(K=1 if ns_steps else 2, NS_STEPS=ns_steps, A_COEF=a, B_COEF=b, C_COEF=c, RESIDUAL=False,
                     READ_AFTER_WRITE=read_after_write, LIMITED=bound, BF16=PRODUCTS[products],
                     **blocks)
    signature = {name: "constexpr" if name in constants else "*fp32" if name.endswith("_ptr") else
                 "i32" if name in INTEGERS else "fp32" for name in fn.arg_names}
    # what a launch specializes on (Triton's JIT): pointers (torch's allocations) and the sizes that
    # are multiples of 16 are marked so; N and G (the chunk count, the checkpoint stride) are not
    sizes = {"C": chunk, "D": dim, "HD": hidden}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name.endswith("_ptr") or sizes.get(name, 1) % 16 == 0}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    # bf16_mma: Triton's MMAv2 (mma.sync) instead of wgmma, as the "mma" mode launches them
    with without_wgmma() if products == "bf16_mma" else contextlib.nullcontext():
        return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": 1})


def compile_inputs_variant(kernel: str, rule: str, dim: int, chunk: int, arch: int, heads: int = 16):
    """The compiled input-preparation kernel (`kernel` "inputs_fwd" or "inputs_bwd") of the layer of
    `rule` (module docstring), at bf16 activations."""
    fn = getattr(memory_inputs_triton, f"chunk_inputs_{kernel.split('_')[1]}")
    token = rule == "token"
    constants = dict(HAS_BIAS=not token, QK_NORM=True, VALUE_SILU=token, MOMENTUM=True, FORGET=True, ROUND=True,
                     TOKEN=token, TAPS=4 if token else 0, BC=triton.next_power_of_2(chunk),
                     BD=triton.next_power_of_2(dim))
    activations = ("QKV", "LOGITS", "HISTORY")
    signature = {name: "constexpr" if name in constants else "*bf16" if name in activations else "i32"
                 if "stride" in name or name in ("H", "N", "C", "D") else "fp32" if name in ("max_lr", "forget_offset")
                 else "*fp32" for name in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": INPUTS_WARPS, "num_stages": 1})


def ptxas_usage(compiled) -> dict:
    """{"registers", "spill_stores", "spill_loads"} (per thread, bytes for spills) of a compiled
    kernel, from `ptxas -v` on its PTX with the flags Triton's own build passes: the kernel's
    registers, the spills summed over it and the functions it calls (each reported apart)."""
    ptxas = get_ptxas(compiled.metadata.target.arch).path
    arch = sm_arch_from_capability(compiled.metadata.target.arch)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([ptxas, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", ptx, "-o", ptx + ".o"],
                             check=True, capture_output=True, text=True).stderr

    def numbers(pattern):
        return [int(n) for n in re.findall(pattern, log)]

    return {"registers": max(numbers(r"Used (\d+) registers")), "spill_stores": sum(numbers(r"(\d+) bytes spill stores")),
            "spill_loads": sum(numbers(r"(\d+) bytes spill loads"))}


def sass(compiled) -> str:
    """The kernel's SASS, from Triton's bundled nvdisasm on its cubin."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([nvdisasm, "-c", cubin], check=True, capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT))
    p.add_argument("--only", default="fwd,bwd,inputs_fwd,inputs_bwd")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--products", default=",".join(PRODUCTS), help=f"comma-separated: {', '.join(PRODUCTS)}")
    p.add_argument("--max-spill", type=int, default=None, help="one bound for all (default MAX_SPILL_BYTES)")
    p.add_argument("--bound", action="store_true", help="the variants with the surprise bound (`limit`)")
    p.add_argument("--wgmma-hazards", action="store_true", help="scan each kernel's SASS for writes to the registers "
                   "of an in-flight HGMMA (kernels/ptxas.py)")
    a = p.parse_args(argv)
    limit = SHARED_LIMIT[a.arch]
    print(f"triton {triton.__version__}; sm_{a.arch}; head_dim {a.head_dim}, hidden {a.hidden}, chunk {a.chunk}; "
          f"shared memory limit {limit:,} B per block; spill bound per thread "
          f"{a.max_spill if a.max_spill is not None else MAX_SPILL_BYTES} B")
    failed = False
    for kernel in a.only.split(","):
        for rule in a.rules.split(","):
            inputs = kernel.startswith("inputs_")
            for products in ("fp32",) if inputs else a.products.split(","):
                start = time.perf_counter()
                try:
                    compiled = compile_inputs_variant(kernel, rule, a.head_dim, a.chunk, a.arch) if inputs else \
                        compile_variant(kernel, rule, products, a.head_dim, a.hidden, a.chunk, a.arch, a.bound)
                    shared = compiled.metadata.shared
                    usage = ptxas_usage(compiled)
                    spills = max(usage["spill_stores"], usage["spill_loads"])
                    verdict = "fits" if shared <= limit else "DOES NOT FIT"
                    bound = a.max_spill if a.max_spill is not None else INPUTS_MAX_SPILL_BYTES if inputs else \
                        MAX_SPILL_BYTES[products]
                    failed |= shared > limit or spills > bound
                    line = (f"{usage['registers']:>3} registers, spill stores {usage['spill_stores']:>6,} B, "
                            f"loads {usage['spill_loads']:>6,} B{'' if spills <= bound else ' OVER THE BOUND'}; "
                            f"{shared:>9,} B shared, {verdict}")
                    if a.wgmma_hazards:
                        count, hazards = wgmma_hazards(sass(compiled))
                        failed |= bool(hazards)
                        line += f"; {count} HGMMA, {len(hazards)} writes to in-flight HGMMA registers"
                        line += "".join(f"\n    {h}" for h in hazards[:3])
                except Exception as e:  # a variant that does not compile is a finding, not a crash
                    failed = True
                    line = f"DOES NOT COMPILE: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                form = "bf16 activations" if inputs else f"{products} products{' bound' if a.bound else ''}"
                print(f"{kernel} {rule:<14} {form}: {line} ({time.perf_counter() - start:.0f} s)", flush=True)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
