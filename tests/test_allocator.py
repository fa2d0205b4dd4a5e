"""`keep_freed_memory` (torchtitan_ext/allocator.py) makes glibc serve large tensors from the
heap instead of fresh mmap'd pages, in a subprocess (the setting is per process and not
reversible). The bytes glibc holds in mmap'd blocks are read from mallinfo2 here."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from torchtitan_ext.allocator import is_glibc, keep_freed_memory

PROBE = textwrap.dedent("""
    import ctypes, sys, torch
    from torchtitan_ext.allocator import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def mmapped_growth() -> int:
        before = libc.mallinfo2().hblkhd
        block = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB: above glibc's largest dynamic threshold
        return libc.mallinfo2().hblkhd - before

    default = mmapped_growth()
    applied = keep_freed_memory()
    print(default, applied, mmapped_growth())
""")


@pytest.mark.skipif(not is_glibc(), reason="mallopt thresholds are glibc's")
def test_large_tensors_leave_mmap_once_freed_memory_is_kept():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    default, applied, kept = int(out[0]), out[1], int(out[2])
    assert default >= 64 << 20  # glibc's default: a fresh mapping for the block
    assert applied == "True" and kept == 0  # after: served from the heap


def test_other_c_libraries_are_left_alone(monkeypatch):
    monkeypatch.setattr("torchtitan_ext.allocator.platform.libc_ver", lambda: ("", ""))
    assert keep_freed_memory() is False
