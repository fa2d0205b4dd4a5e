"""Run torchtitan 0.3.0's own Trainer on a machine without an accelerator.

`apply()` is called by the launcher before `torchtitan.trainer` is imported. It
does nothing when an accelerator is present. Each patch below names the
failure it fixes; version workarounds are gated on the capability they need,
so they switch themselves off on a torch/torchtitan pairing that no longer
needs them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import resource
import sys
import time
from types import SimpleNamespace

import torch


def has_accelerator() -> bool:
    return torch.accelerator.is_available()


class CpuDeviceModule:
    """Stand-in for `torch.cuda` in torchtitan's trainer, memory monitor and profiler.

    Peak memory is the process's peak RSS (`ru_maxrss`); it cannot be reset, so
    `reset_peak_memory_stats` is a no-op and the figure is the peak since start.
    """

    memory = SimpleNamespace(
        _record_memory_history=lambda *a, **k: None,
        _dump_snapshot=lambda *a, **k: None,
    )

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def get_device_name(device=None) -> str:
        return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"

    @staticmethod
    def get_device_properties(device=None):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return SimpleNamespace(total_memory=total, name=CpuDeviceModule.get_device_name())

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }


@functools.cache
def measured_matmul_flops(n: int = 2048, repeats: int = 3, device: str = "cpu", dtype=torch.float32) -> float:
    """FLOP/s of an n x n matmul in `dtype` on `device` (best of `repeats`; torch only, no torchtitan)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    a @ b  # warm-up
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _patch_device_detection() -> None:
    # Fixes: `device_module.set_device` on "cuda" at Trainer start, because
    # torchtitan.tools.utils.get_device_info() falls back to "cuda" when no
    # accelerator is found. About ten torchtitan modules copy `device_type` /
    # `device_module` at import time, so already-imported ones are patched too.
    import torchtitan.tools.utils as tt_utils

    original_module = tt_utils.device_module
    tt_utils.device_type = "cpu"
    tt_utils.device_module = CpuDeviceModule
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_module", None) is original_module:
            module.device_module = CpuDeviceModule
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
    # MFU on CPU: torchtitan looks peak FLOP/s up by GPU name and falls back to
    # an A100's. Use this machine's measured fp32 matmul FLOP/s instead, at n = 1024:
    # 0.4 s on one core instead of 2048's 3 s, paid by every rank of every launch.
    tt_utils.get_peak_flops = lambda device_name: measured_matmul_flops(1024)


def _patch_gloo_gradient_reduction() -> None:
    # Fixes: "Cannot use ReduceOp.PREMUL_SUM with Gloo" with 2+ ranks. torchtitan
    # sets FSDP2's gradient divide factor to 1.0, which makes FSDP2 reduce with
    # PREMUL_SUM (and AVG when no factor is set); gloo has neither. FSDP2's own
    # "force sum" mode reduces with SUM and divides afterwards: same result.
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    original = collectives._get_gradient_divide_factors

    @functools.wraps(original)
    def sum_then_divide(rs_group, ar_group, reduce_dtype, device_type="", factor=None, _=False):
        return original(rs_group, ar_group, reduce_dtype, device_type, factor, True)

    collectives._get_gradient_divide_factors = sum_then_divide


def flushing_denormals() -> bool:
    """Whether the calling thread flushes subnormal floats to zero, the setting
    `torch.set_flush_denormal` changes (torch has no getter: with it on, a subnormal float64
    compares equal to 0)."""
    return torch.tensor([1e-323], dtype=torch.float64).item() == 0.0


@contextlib.contextmanager
def denormals_flushed():
    """Flush subnormal floats inside the block (as `apply` does for a training process, and for
    the same reason) and restore the calling thread's setting after it; also a decorator."""
    before = flushing_denormals()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


def apply(flush_denormals: bool = True) -> bool:
    """Apply the CPU support if there is no accelerator. Returns whether it applied.
    `flush_denormals` False leaves the subnormal setting to the caller (`denormals_flushed`)."""
    if has_accelerator():
        return False
    _patch_device_detection()
    _patch_gloo_gradient_reduction()
    # Subnormal floats in the backward of the test-time memories' inner loop made CPU
    # steps ~30-100x slower (measured: titans_lmm_debug fwd+bwd 10.1 s -> 0.27 s).
    if flush_denormals:
        torch.set_flush_denormal(True)
    return True
