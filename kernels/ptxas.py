"""Which ptxas assembles Triton's Hopper kernels, and where the whole-sequence kernels run their bf16
products on the tensor cores with it (`TENSOR_CORES_ENV`, `tensor_core_mode`).

CUDA's ptxas before 13.3 can reuse a register that an asynchronous Hopper `wgmma` is still
reading when the instruction takes its A operand from registers: the product comes out wrong.
NVIDIA lists the fix in CUDA 13.3's release notes, and Triton's main branch assembles Hopper
kernels with its bundled CUDA 13 ptxas since (triton-lang/triton pull request 11781). Triton 3.6,
the GPU image's, assembles sm_90 with its bundled ptxas 12.8.93. The whole-sequence kernels
(kernels/whole_sequence_triton.py) take their `wgmma` A operands from registers; their bf16
tensor-core variant crashed at the Titans shape and gave wrong values at Mela's on an H200 with
Triton 3.6 and its ptxas 12.8 (2026-11-28, fourth lease). On the fifth lease (H200, 2026-11-28),
the same Triton with ptxas 13.5 ran them equal to the float64 reference at both memories' 400m
options (per-token rule and Newton-Schulz; docs/benchmarks.md, "Fifth lease"). So the default
(`auto`) takes the tensor cores through `wgmma` on Hopper where Triton's ptxas is >= 13.3
(`tensor_core_products`), after `use_fixed_ptxas` has pointed Triton at an installed fixed one: a
CUDA >= 13.3 toolkit, `pip install nvidia-cuda-nvcc>=13.3` (the `gpu` extra), or a Triton that
bundles one as `ptxas-blackwell` (Triton 3.9: 13.4). Without one it multiplies bf16-rounded
operands on the FMA units (the same values) and warns once, naming the fix. Pointing Triton
at the fixed ptxas holds for every Triton kernel of the process (inductor's and flex attention's
too), whether or not a model uses these kernels; on the fifth lease MAC's compiled step ran so.
Other architectures run the FMA units by default: no lease has run the tensor-core variant there; `wgmma` / `mma`
ask for it anywhere (Ampere's `mma.sync` is synchronous, Blackwell's `tcgen05` reads no operand
from registers), `fma` keeps the FMA units everywhere.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import subprocess
import sys
import warnings

WGMMA_FIXED = (13, 3)  # the first ptxas without the register-operand wgmma hazard (CUDA 13.3 release notes)
HOPPER = 90
# The whole-sequence kernels' bf16 products (module docstring): "auto" (unset or empty), "wgmma"
# on Hopper with a ptxas >= 13.3, else the FMA units; "wgmma": Hopper's asynchronous wgmma, as Triton
# lowers tl.dot on sm_90 (needs ptxas >= 13.3 there), on any GPU; "mma": the synchronous mma.sync
# (Triton's MMAv2, DISABLE_MMA_V3 set while these kernels compile; not yet run on a GPU); "fma":
# bf16-rounded operands on the FMA units everywhere.
TENSOR_CORES_ENV = "WHOLE_SEQUENCE_TENSOR_CORES"
TENSOR_CORE_MODES = ("auto", "wgmma", "mma", "fma")


def tensor_core_mode() -> str:
    """`TENSOR_CORES_ENV`'s value: "auto" (unset or empty), "wgmma", "mma" or "fma"; ValueError
    naming the choices for anything else."""
    mode = os.environ.get(TENSOR_CORES_ENV) or "auto"
    if mode not in TENSOR_CORE_MODES:
        raise ValueError(f"{TENSOR_CORES_ENV}={mode!r}: choose one of {', '.join(TENSOR_CORE_MODES)} (unset: auto)")
    return mode


# Triton's knobs for its two ptxas: sm_90 reads the first up to Triton 3.6, the second (named
# for Blackwell) in Triton 3.9; `use_fixed_ptxas` sets both.
ENVS = ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")


@functools.lru_cache(maxsize=None)
def version_of(path: str) -> tuple[int, int] | None:
    """(major, minor) of the ptxas at `path` from `--version` ("release 13.4"), None if it does not run."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else None


def triton_ptxas(arch: int = HOPPER) -> str | None:
    """The path of the ptxas Triton assembles `arch` (e.g. 90) with, honouring its knobs (`ENVS`);
    None without Triton's NVIDIA backend or its ptxas (Triton raises RuntimeError for a missing
    binary; older ones take no `arch`)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch).path
    except (ImportError, RuntimeError, TypeError):
        return None


def tensor_core_products(arch: int, ptxas_version: tuple[int, int] | None) -> bool:
    """Whether the whole-sequence kernels may run bf16 products on the tensor cores of an `arch`
    GPU whose Triton assembles with a ptxas of `ptxas_version` (module docstring)."""
    return arch != HOPPER or (ptxas_version is not None and ptxas_version >= WGMMA_FIXED)


def fixed_ptxas_candidates() -> list[str]:
    """Where a ptxas >= 13.3 may be installed, in order: Triton's knobs (`ENVS`), the CUDA toolkit
    ($CUDA_HOME, /usr/local/cuda), pip's nvidia-cuda-nvcc (nvidia/cu13/bin), Triton's own
    ptxas-blackwell."""
    paths = [os.environ.get(name, "") for name in ENVS]
    for home in (os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"):
        if home:
            paths.append(os.path.join(home, "bin", "ptxas"))
    for site in sys.path:
        paths += sorted(glob.glob(os.path.join(site, "nvidia", "cu1[3-9]", "bin", "ptxas")))
    paths.append(triton_ptxas(100) or "")
    return [p for p in dict.fromkeys(paths) if p and os.path.isfile(p)]


def arch_of(device) -> int | None:
    """The compute capability of a CUDA torch device as Triton names it (90 for 9.0), else None."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def use_fixed_ptxas(arch: int | None) -> str | None:
    """In the "auto" and "wgmma" modes (`tensor_core_mode`), on an sm_90 GPU whose Triton ptxas is
    older than 13.3: point Triton's knobs (`ENVS`) at the first fixed ptxas found
    (`fixed_ptxas_candidates`) and return it; else change nothing and return None (in the "mma"
    and "fma" modes every Triton kernel keeps the ptxas it had). Call before any Triton kernel is
    compiled (a run's start); a ptxas from a newer CUDA major version than the driver's is skipped
    (its binaries need that driver). `arch` None (not a CUDA device, `arch_of`): nothing."""
    if (tensor_core_mode() not in ("auto", "wgmma") or arch != HOPPER
            or tensor_core_products(arch, version_of(triton_ptxas(arch) or ""))):
        return None
    driver = driver_major()
    for path in fixed_ptxas_candidates():
        version = version_of(path)
        if version is not None and version >= WGMMA_FIXED and (driver is None or version[0] <= driver):
            os.environ.update({name: path for name in ENVS})
            return path
    return None


def driver_major() -> int | None:
    """The CUDA major version the installed driver supports (13 for 13000), None unknown."""
    import torch

    version = getattr(torch._C, "_cuda_getDriverVersion", lambda: 0)()
    return version // 1000 if version else None


_warned = False


def warn_fma_fallback(arch: int) -> None:
    """Once per process: the kernels run their bf16 products on the FMA units because the "auto" or
    "wgmma" mode met an old ptxas on Hopper."""
    global _warned
    if not _warned:
        _warned = True
        path = triton_ptxas(arch)
        version = ".".join(map(str, version_of(path or "") or ("unknown",)))
        warnings.warn(f"whole-sequence memory kernels: Triton assembles sm_{arch} with ptxas {version} "
                      f"({path}), older than {WGMMA_FIXED[0]}.{WGMMA_FIXED[1]} (NVIDIA fixed a register-operand "
                      f"wgmma fault in 13.3), so their bf16 products run on the FMA units (slower; not yet measured); "
                      f"fix: pip install 'nvidia-cuda-nvcc>=13.3' (found at the run's start: kernels/ptxas.py "
                      f"use_fixed_ptxas) or set {' and '.join(ENVS)} to a CUDA >= 13.3 ptxas",
                      stacklevel=3)


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*(.*?)\s*;")
# opcodes that write no general register (stores, barriers, branches, fences, uniform-datapath ops)
_NO_REGISTER_DEST = ("ST", "BAR", "BRA", "WARPGROUP", "EXIT", "RET", "CALL", "RED", "MEMBAR", "DEPBAR",
                     "NOP", "BSYNC", "BSSY", "WARPSYNC", "FENCE", "ERRBAR", "CCTL", "YIELD", "SYNCS", "U")


def _written(op: str, args: str) -> set[int]:
    """The general registers an instruction writes: its first operand R<n>, 4 registers for .128
    and the 4-matrix LDSM (.4), 2 for .64, .WIDE and the 2-matrix LDSM (.2), else 1; none for
    opcodes without a register destination."""
    first = re.fullmatch(r"R(\d+)", args.split(",")[0].strip())
    if op.startswith(_NO_REGISTER_DEST) or not first:
        return set()
    matrices = re.fullmatch(r"LDSM\..*\.(\d)", op)
    width = (int(matrices.group(1)) if matrices else 4 if ".128" in op else 2 if ".64" in op or ".WIDE" in op
             else 1)
    return set(range(int(first.group(1)), int(first.group(1)) + width))


def wgmma_hazards(sass: str) -> tuple[int, list[str]]:
    """(HGMMA count, hazards) in nvdisasm output: every write, by another instruction, to a
    register an issued HGMMA still reads or writes (its register A operand, 4 registers for
    m64 x k16 bf16, or its accumulator, N / 2 registers for m64 x N), and every HGMMA whose
    accumulator overlaps an in-flight one's A operand, before the `WARPGROUP.DEPBAR.LE gsb0, 0x0`
    that waits for all; scanned in address order (a straight-line approximation: a branch is not
    followed). The pattern of ptxas's register-operand wgmma fault before CUDA 13.3 (module
    docstring). HGMMAs chaining one accumulator are the normal case, not a hazard."""
    count, hazards, operands_in_flight, accumulators_in_flight = 0, [], [], []
    for line in sass.splitlines():
        found = _SASS_LINE.search(line)
        if not found:
            continue
        address, op, args = found.groups()
        if op.startswith("HGMMA"):
            count += 1
            operands = [a.strip() for a in args.split(",")]
            n = int(re.search(r"64x(\d+)x", op).group(1))
            accumulator = set(range(int(operands[0][1:]), int(operands[0][1:]) + n // 2))
            hazards += [f"{address}: {op} accumulator overlaps the A operand of the HGMMA at {at}"
                        for a, at in operands_in_flight if accumulator & a]
            accumulators_in_flight.append((accumulator, address))
            if operands[1].startswith("R"):
                operands_in_flight.append((set(range(int(operands[1][1:]), int(operands[1][1:]) + 4)), address))
        elif op.startswith("WARPGROUP.DEPBAR") and args.endswith("0x0"):
            operands_in_flight, accumulators_in_flight = [], []
        else:
            written = _written(op, args)
            hazards += [f"{address}: {op} {args} writes the {what} of the HGMMA at {at}"
                        for what, in_flight in (("A operand", operands_in_flight),
                                                ("accumulator", accumulators_in_flight))
                        for registers, at in in_flight if written & registers]
    return count, hazards
