"""What backend "auto" runs, by measurement: (device kind, op, shape class) -> backend.

`kernels._resolve` looks a call up here: device kind is the tensor's device type, op
"newton_schulz" or "memory_update", and the shape class (`kernels.shape_class`) is "tile"
when each matrix fits one program of the per-matrix Triton kernel (small side <= MAX_ROWS,
large side <= MAX_COLS: the memories' fast weights) else "large", then "-few" for at most
MANY_MATRICES matrices in the call (batch x heads) else "-many" (one program per matrix:
few matrices leave most of a GPU idle). A class not in the table, or an entry a call cannot
take (`kernels.can_run`: Triton needs CUDA, fp32 / bf16, the tile), runs its device
kind's DEVICE_DEFAULTS entry: compiled torch on CUDA until a kernel is measured faster; a
kind without one (CPU, meta) runs the eager torch reference (a compiled model compiles it
with the rest). Where the Triton kernels are absent (no triton, or a Hugging Face export)
"auto" is the eager torch reference on every device.

Written from `scripts/gpu_check.py --only kernels`, which times every backend (forward +
backward, ms) at one shape per class and prints this table from its measurements (a kernel
replaces the default only when it is faster by more than gpu_check's margin). Filled from
the one H100 lease so far (2026-11-22, torch 2.11, Triton 3.6, docs/benchmarks.md): 16
matrices each of 64 x 256 and 256 x 64, the figures the two orientations' sums.
"""

MAX_ROWS, MAX_COLS = 128, 512  # the per-matrix Triton kernel's largest matrix, either orientation: class "tile"
MANY_MATRICES = 64  # more matrices than this in one call: class "-many"

DEVICE_DEFAULTS = {"cuda": "compiled"}

AUTO_TABLE = {  # ms per forward + backward
    ("cuda", "newton_schulz", "tile-few"): "compiled",  # torch 6.28, compiled 4.65, triton 6.53, triton_blocked 7.10
    ("cuda", "memory_update", "tile-few"): "compiled",  # torch 5.79, compiled 4.18, triton 7.91
}
