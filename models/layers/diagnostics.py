"""Opt-in diagnostics of the memory models (the Titans thesis' monitoring: fast-weight norms,
gate statistics, the memory's share of a block's update; Mela's cycle changes; the attention
mass on memory tokens).

Model code computes them only while `recording()` is on: off (the default) a training step
runs none of their ops and keeps no tensor for them, so a step is the same kernels every time
(what CUDA-graph capture needs) and pays nothing for statistics nobody reads. The trainer turns
recording on for the steps it logs (`MemoryTrainer.train_step`: every `--metrics.log_freq`
steps); a study that reads them every step wraps its loop in `recording()`.

Under torch.compile the switch is a Python global that dynamo guards on: a compiled region
holds one graph with the statistics and one without, the former run only on logged steps.
"""

from __future__ import annotations

import contextlib

_recording = False


def recording_on() -> bool:
    """Whether model code records its diagnostics now."""
    return _recording


@contextlib.contextmanager
def recording(on: bool = True):
    """Record diagnostics (`on`) or not inside the block; restores the previous setting."""
    global _recording
    previous, _recording = _recording, bool(on)
    try:
        yield
    finally:
        _recording = previous
