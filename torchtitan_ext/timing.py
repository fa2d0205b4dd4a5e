"""Timing for the benchmarks and gpu_check (torch only: runs where torchtitan cannot)."""

from __future__ import annotations

import statistics
import time

import torch


def median_seconds(fn, repeats: int, device: str | torch.device = "cpu") -> float:
    """Median wall seconds of `fn()` over `repeats` calls after one untimed warm-up call
    (compilation, allocator), with a CUDA `device` synchronised after each call."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
