"""The H100 roofline the step is costed on, the per-launch cost of each mode, and the cost records (`Cost`, `StepCost`, `Tag`)."""

from __future__ import annotations


from dataclasses import dataclass, field

import torch



# --- H100 SXM (the lease's card) ---
BF16_PEAK = 989e12  # dense bf16 tensor-core FLOP/s
FP32_PEAK = 67e12  # fp32 without tensor cores (torch's matmul default allow_tf32=False)
TF32_PEAK = 494e12  # dense TF32 tensor-core FLOP/s (allow_tf32=True)
FP64_PEAK = 67e12  # fp64 tensor cores
HBM_BYTES_PER_S = 3.35e12
SMS = 132  # streaming multiprocessors (one whole-sequence program per (batch, head) runs on one)
# The whole per-launch cost outside the roofline, by how the step runs (module docstring, "Modes"):
LAUNCH_S = {
    # The lease's fit (H100, 2026-11-26, bench_models.py eager, batch 2 x T 4096): mela_400m's measured step
    # (4,874 tokens/s) at 24.4 us per launch with the FLOP-bearing ops at peak; titans_mac_400m's fits 54 us
    # (its per-chunk Python): the lower of the two.
    "eager": 24e-6,
    # Not measured on a lease yet (assumed): Inductor's generated code launches each fused kernel through
    # Triton's launcher, with no dispatcher or autograd per op: the CUDA driver's 4-6 us per launch
    # (pegainfer, "From launch overhead to CUDA graph", RTX 5070 Ti) plus the launcher's Python, ~10 us.
    "compiled": 10e-6,
    # CUDA graph replay: one host launch for the whole step, each kernel node ~0.5 us of device-side
    # overhead (NVIDIA, "Getting started with CUDA graphs", 2019: 3.4 us per 2.9 us kernel replayed,
    # vs 3.8 us launched); taken as 1 us.
    "graphs": 1e-6,
}
MODES = tuple(LAUNCH_S)
LAUNCH_FLOOR_S = 5e-6  # the roofline tests' floor (`Hardware` default): the kernel launch alone
HOST_SYNC_S = 20e-6  # one device-to-host round trip (the queue drains)
MULTI_TENSOR_LIST = 36  # tensors per launch of a multi-tensor op (torch's depth-4 lists)
MULTI_TENSOR_ELEMENTS = 320 * 65536  # elements per launch (blocks x chunk size)

# The whole-sequence kernels' achieved FLOP/s per program (one (batch, head) program per SM), measured on the fifth
# lease (one H200, 2026-11-28, torch 2.11 + Triton 3.6 with ptxas 13.5, bf16 products through wgmma):
# titans_mac_400m on the whole-sequence path, compiled and graph-replayed, batch 2 x T 4096 (bench_models.py
# --profile): whole_sequence_fwd 105.7 ms and whole_sequence_bwd 303.7 ms of CUDA time per step, over this model's
# FLOPs for the same 152 launches of 32 programs (816.0 and 2,692.9 GFLOPs, `kernels.whole_sequence.kernel_cost`).
# That is 3.2% / 3.7% of an SM's share of the bf16 peak, and below its share of the fp32 FMA peak (0.51 TFLOP/s):
# each program is bound by the latency of its serial chain over chunks, not by the units that multiply.
# Out of sample (the same lease's bench_whole_sequence.py, B 2, H 16, T 4096, every chunk's state kept): the
# Newton-Schulz kernels (Mela's rule) at these rates take 59.4 ms per layer step against 54.2 ms measured for the
# whole layer, the per-token ones 18.7 ms against 23.9 ms (docs/benchmarks.md, "Fifth lease").
# (kernel FLOPs per step, measured CUDA seconds per step, programs per launch) of that profile
_MEASURED_KERNELS = {"forward": (816.0e9, 105.7e-3, 32), "backward": (2_692.9e9, 303.7e-3, 32)}
KERNEL_PROGRAM_FLOPS = {kind: flops / seconds / programs  # 0.241e12 forward, 0.277e12 backward
                        for kind, (flops, seconds, programs) in _MEASURED_KERNELS.items()}

CLASSES = ("attention", "memory update", "memory read", "decoder matmuls", "elementwise", "optimizer")

# The lease's measurements (H100, scripts/bench_models.py plain loop, bf16 autocast, batch 2,
# seq 4096): (model, flavor, mode) -> (tokens/s, MFU % or None).
MEASURED_H100 = {
    ("transformer", "400m", "eager"): (75_782, 26.2),
    ("transformer", "400m", "compiled"): (120_264, 41.5),  # then bench_models.py compiled the whole model
    ("titans_mac", "400m", "eager"): (599, None),
    ("mela", "400m", "eager"): (4_874, None),
}
MEASURED_SHAPE = (2, 4096)  # (batch, seq_len) of MEASURED_H100


@dataclass(frozen=True)
class Hardware:
    """The roofline the ops are costed on (module constants: an H100 SXM)."""

    bf16_flops: float = BF16_PEAK
    fp32_flops: float = FP32_PEAK
    tf32_flops: float = TF32_PEAK
    fp64_flops: float = FP64_PEAK
    bytes_per_s: float = HBM_BYTES_PER_S
    launch_s: float = LAUNCH_FLOOR_S
    sync_s: float = HOST_SYNC_S
    tf32: bool = False  # fp32 matmuls on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32)
    # the whole-sequence kernels' bf16 products on the tensor cores (the default on Hopper with a ptxas >= 13.3:
    # kernels/ptxas.py); False: on the FMA units (no fixed ptxas, or WHOLE_SEQUENCE_TENSOR_CORES=fma)
    kernel_tensor_cores: bool = True
    # the whole-sequence kernels' programs at most at the lease's measured rate (`KERNEL_PROGRAM_FLOPS`);
    # False: at their share of the peak alone (the roofline before that lease)
    kernel_measured: bool = True
    sms: int = SMS

    @classmethod
    def for_mode(cls, mode: str, **fields) -> "Hardware":
        """The H100 with the per-launch cost of `mode` (`LAUNCH_S`) unless `launch_s` is given."""
        if mode not in LAUNCH_S:
            raise ValueError(f"unknown mode '{mode}': choose from {', '.join(MODES)}")
        return cls(**{"launch_s": LAUNCH_S[mode], **fields})

    def program_flops(self, programs: int, bf16: bool, backward: bool = False) -> float:
        """The FLOP/s of a kernel of `programs` one-SM programs (the whole-sequence kernels): the
        bf16 tensor-core peak for bf16 products with `kernel_tensor_cores`, else the fp32 FMA
        peak, times the share of the SMs it occupies; with `kernel_measured`, at most the lease's
        measured rate per program (`KERNEL_PROGRAM_FLOPS`, forward or `backward`) times the
        programs that run at once."""
        peak = self.bf16_flops if bf16 and self.kernel_tensor_cores else self.fp32_flops
        running = min(programs, self.sms)
        rate = peak * running / self.sms
        if self.kernel_measured:
            rate = min(rate, KERNEL_PROGRAM_FLOPS["backward" if backward else "forward"] * running)
        return rate

    def peak(self, dtype: torch.dtype | None) -> float:
        if dtype in (torch.bfloat16, torch.float16):
            return self.bf16_flops
        if dtype == torch.float64:
            return self.fp64_flops
        return self.tf32_flops if self.tf32 else self.fp32_flops


@dataclass
class Cost:
    """Launches, FLOPs, bytes and predicted seconds of a set of ops: `compute_s` the
    roofline part (max of FLOPs / peak and bytes / bandwidth per op), `launch_s` the floors."""

    launches: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    compute_s: float = 0.0
    launch_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.compute_s + self.launch_s

    def add(self, other: "Cost") -> None:
        self.launches += other.launches
        self.flops += other.flops
        self.bytes += other.bytes
        self.compute_s += other.compute_s
        self.launch_s += other.launch_s


@dataclass
class StepCost:
    """One recorded step: costs by class (`CLASSES`) and by aten op, host syncs, fp32 matmuls
    (the FLOPs that ran at the fp32 peak), launches per memory module ([forward, backward]:
    backward includes recomputed chunks), the device the step ran on (meta) and the wall time
    of the recording."""

    hardware: Hardware
    tokens: int = 0
    classes: dict = field(default_factory=lambda: {c: Cost() for c in CLASSES})
    ops: dict = field(default_factory=dict)  # (class, aten op) -> Cost
    functions: dict = field(default_factory=dict)  # model function ("file.py:name") -> Cost, backward included
    syncs: int = 0
    sync_ops: dict = field(default_factory=dict)
    fp32_matmul: Cost = field(default_factory=Cost)
    fp32_functions: dict = field(default_factory=dict)  # model function -> fp32 matmul launches
    memory_layers: dict = field(default_factory=dict)
    region_launches: int = 0  # launches booked inside the recipe's compiled regions (Tag.region)
    device: str = ""
    record_s: float = 0.0

    @property
    def total(self) -> Cost:
        total = Cost()
        for cost in self.classes.values():
            total.add(cost)
        return total

    @property
    def sync_s(self) -> float:
        return self.syncs * self.hardware.sync_s

    @property
    def step_s(self) -> float:
        return self.total.seconds + self.sync_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s else 0.0


@dataclass(frozen=True)
class Tag:
    """The forward context of an op: module path, the memory module it is inside (or ""),
    read / update inside a memory, attention, inside a compiled region, model function."""

    module: str = ""
    memory: str = ""
    read: bool = False
    attention: bool = False
    compiled: bool = False
    function: str = ""  # the innermost model function (models/, kernels/) on the stack, "file.py:name"
    region: bool = False  # inside what the recipe compiles (its modules and functions; not kernels' own compile)
