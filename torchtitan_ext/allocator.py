"""glibc malloc's thresholds, which CPU timings of PyTorch code depend on.

torch's CPU tensors come from the C allocator. glibc serves a block above its mmap threshold
(128 KiB at start, raised dynamically up to 32 MiB as large blocks are freed) with fresh pages
from mmap and unmaps it on free, and it trims the heap's top above its trim threshold. A
program that allocates and frees the same large tensors again and again then page-faults (and
has the kernel zero) every one of them each time. Measured by `scripts/bench_memory.py` on
this project's 2-core CPU (docs/benchmarks.md): titans-pytorch's memory layer spends more than
half of its time there at chunk 16; ours much less.

`keep_freed_memory` raises both thresholds once for the process (`mallopt`), so freed blocks
stay in the heap and are reused: the effect of preloading jemalloc or tcmalloc, which CPU
PyTorch performance guides recommend. Not reversible: glibc's dynamic threshold stays off once
set. The resident size then stays at its peak instead of shrinking after large frees.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEPT_BLOCK_BYTES = 1 << 30  # blocks up to 1 GiB come from the heap and stay there once freed


def is_glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def keep_freed_memory(threshold_bytes: int = KEPT_BLOCK_BYTES) -> bool:
    """Raise glibc's mmap and trim thresholds to `threshold_bytes` for this process. Returns
    True when both were set, False where the C library is not glibc (nothing changed)."""
    if not is_glibc():
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold_bytes)) and bool(libc.mallopt(M_TRIM_THRESHOLD, threshold_bytes))
