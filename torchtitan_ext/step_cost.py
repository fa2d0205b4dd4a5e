"""Where a training step's time goes on an H100, predicted without a GPU (issue 39, item 1).

One training step (forward, backward, optimizer step) of a family's model is recorded on the
meta device (shapes and dtypes only: no memory, no compute) at the flavor's real shape, with
the loop of scripts/bench_models.py: random tokens (B, T + 1), bf16 autocast with fp32
parameters, cross-entropy (plus a model's own loss term), fused AdamW. Every aten op the step
executes is seen by a TorchDispatchMode and costed on an H100:

    time(op) = max(FLOPs / peak, bytes / HBM_BYTES_PER_S) + LAUNCH_FLOOR_S     (one launch)
    step     = sum over ops + HOST_SYNC_S x host syncs

The ops run back to back (no overlap of host and device); the launch floor (`LAUNCH_S` of the
mode) stands for the whole per-op cost outside the roofline: an eager step whose kernels are
tiny is bound by the host (Python, dispatcher, autograd per op). `report` prints, beside a
lease measurement, the per-launch cost at which the measured step fits (`--launch-floor-us`
sets it), and the Transformer++ of the same flavor in the same mode beside the model.

- FLOPs: torch's own formulas (`torch.utils.flop_counter.flop_registry`: mm, addmm, bmm,
  baddbmm, convolutions and their backward); fused attention kernels 4 B H Lq Lk D forward and
  10 B H Lq Lk D backward (flash attention recomputes the scores), halved when causal. Other
  ops count no FLOPs (their time is the bytes they move). The peak is the matmul's input
  dtype's: bf16 989e12 (dense), fp32 67e12 (no tensor cores: torch's default
  `allow_tf32=False` for matmuls, which bench_models.py leaves), TF32 494e12 with `tf32=True`.
- Bytes (the approximation): the sum of the op's distinct input tensors' and its outputs'
  sizes in their dtypes, a broadcast (stride 0) dimension counted once; an in-place op's
  tensor counts as read and written. No cache reuse between ops, no partial reads.
- Launches: one per op that runs a kernel; views, `detach`, `empty*` and other metadata ops
  run none. A multi-tensor op (`_foreach_*`, `_fused_adamw_`) counts one launch per
  MULTI_TENSOR_LIST tensors (or per MULTI_TENSOR_ELEMENTS elements, whichever is more).
- Host syncs: `aten._local_scalar_dense` (`.item()`, `bool(tensor)`), `nonzero`,
  `masked_select`, `equal`, and copies from the device to the CPU. On meta they cannot run:
  each is counted and answered with a placeholder (0, an empty result), so a step whose
  control flow depends on such a value is recorded along one path only.

The recording follows what the same code does on CUDA where the meta device would take
another branch (each switch is undone after the step):
- bf16 autocast is emulated (meta has no autocast) by a TorchFunctionMode: torch's CUDA
  lower-precision list (linear, matmul, mm, bmm, baddbmm, addmm, conv, SDPA, ...) casts its
  fp32 inputs to bf16, a leaf parameter once per forward (autocast's weight cache), and the
  fp32 list (softmax, log_softmax, cross_entropy, exp, log, pow, sum, ...) lifts bf16 inputs
  to fp32 (sum, cumsum, prod, softmax, log_softmax through their dtype argument, as autocast
  does), leaving nn.RMSNorm in its input's dtype; `kernels.full_precision` (autocast off around the fast-weight state update) turns
  the emulation off as it turns autocast off on CUDA. Inside a checkpointed region's
  recompute autocast is on, as torch's checkpoint restores it; elsewhere in backward off.
- SDPA runs as the CUDA kernels would: flash attention (`_scaled_dot_product_flash_attention`,
  GQA native) without a mask, memory-efficient attention with one (meta would run SDPA's
  unfused math path). F.rms_norm (nn.RMSNorm) runs as `_fused_rms_norm`, torch's one-kernel
  CUDA RMSNorm.
- `models.layers.attention.masked_attention` (Titans' attention) takes its CUDA branch,
  eager flex attention, which torch runs unfused: `create_block_mask` evaluated densely
  (once per shape where the model builds it once: `flex_block_mask` builds on meta too), then torch's own `math_attention` (scores materialised in fp32, where-mask, logsumexp,
  softmax, @ v), differentiated by autograd (torch's eager backward recomputes the scores
  instead: the op count is close, the saved bytes differ). Its FLOPs are the dense matmuls'
  (no block skipping), its matmuls autocast to bf16 (the flex HOP falls through the
  autocast key, so the ops of its dense implementation are autocast as any other; assumed,
  not measured).
- `kernels` backend "auto" resolves to "compiled" on CUDA (`kernels/auto_table.py`), so the
  chunk rule's update (`memory_update_reference`, `newton_schulz_reference`: Mela) runs
  through torch.compile even in an eager model; its ops are costed as a compiled region.
  The per-token rule's chunk step (Titans) stays eager ("auto" never picks a fused step).
- The optimizer step is torch's fused AdamW (bench_models.py on CUDA) called directly:
  `_foreach_add_` on the step counters, then `_fused_adamw_` (AdamW refuses meta tensors).

Modes (`predict(mode=...)`, `LAUNCH_S` the per-launch cost of each, with its source):
- "eager": every op one launch.
- "compiled": the modules the family's training compiles (`Family.compiled_module_names`:
  torchtitan's per-block compile of `layers`, each block with fullgraph=True; Titans' regions,
  `compile_regions`, and with the chunk loop its chunk step) are compiled regions, every
  other module and the loss run eager, as in training. Inside a compiled region, a crude model
  stated plainly: every run of consecutive non-matmul ops (between two matmul or attention
  ops, in execution order) is one fused kernel: one launch, moving the bytes of the largest
  op of the run. Matmuls keep their cost. Compiled flex attention is one fused kernel (costed
  as flash attention whose FLOPs are scaled by the mask's density).
- "graphs": compiled so, and the whole step captured once and replayed as a CUDA graph: the
  same kernels, each at the graph's per-node cost.

Classes (each op in exactly one; they sum to the total):
- optimizer: every op of the optimizer step.
- attention: fused attention kernels, and every op of the eager flex path (block mask,
  scores, softmax, the two matmuls) and of their backward.
- memory update / memory read: the ops of a neural memory module (any module of
  `models/memory/`, run through its forward or one of its methods called directly, such as
  MAC's `retrieve`), read when they run under `retrieve`, `_output` (the read's norm, gate
  and projection) or `mlp_forward` (the fast-weight MLP applied to queries; in the chunk
  step the same matmul also applies it to the chunk's keys for the write), update otherwise
  (q/k/v projections and conv, gates, chunk gates, per-token gradients, state mix,
  Newton-Schulz, stacking of the state).
- decoder matmuls: every other matmul (projections, SwiGLU, output head, Mela's fusion MLPs).
- elementwise: every other op (norms, activations, residual adds, RoPE, casts, copies,
  embedding, loss).
Backward ops take the class of the forward op that made their autograd node: each node made
under the TorchFunctionMode is tagged with the forward context (module, memory, read or
update, attention, compiled region) and a pre-hook makes the tag current when the node runs;
an untagged node's ops (made inside a composite function) keep the tag of the node run just
before them. Recomputed forward ops (checkpointed chunks) are classed by their own frames.
Each op is also booked under the innermost model function (models/, kernels/) on the Python
stack when its forward op ran ("chunk_write.py:associative_grads"); the report's table of
top functions says which code the launches come from.

Recording time grows with the ops: on a shared 2-core CPU transformer_400m at T 4096 takes
~1 s, mela_400m ~30 s, titans_mac_400m ~90 s (247k launches: the per-chunk loop).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import conv_flop_count, flop_registry

from kernels.whole_sequence import kernel_cost
from models.memory.neural_memory import use_whole_sequence
from torchtitan_ext import plain_step
from torchtitan_ext.families import family_and_overrides

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

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MODEL_DIRS = tuple(os.path.join(_ROOT, d) + os.sep for d in ("models", "kernels"))
_MEMORY_DIR = os.path.join(_ROOT, "models", "memory") + os.sep
READ_FUNCTIONS = frozenset({"retrieve", "_output", "mlp_forward"})  # a memory's read (module docstring)
# `kernels` "auto" on CUDA runs these through torch.compile (kernels/auto_table.py DEVICE_DEFAULTS)
CUDA_COMPILED_FUNCTIONS = frozenset({"memory_update_reference", "newton_schulz_reference"})
CHUNK_STEP_FUNCTIONS = frozenset({"chunk_step"})  # compiled with the model's regions (Titans compile_regions)

# autocast's CUDA op lists, by the Python callable's name (torch.amp autocast docs)
LOWER_PRECISION = frozenset({
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm", "addmv", "addr",
    "mv", "einsum", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "prelu", "chain_matmul", "multi_dot", "scaled_dot_product_attention"})
FULL_PRECISION = frozenset({
    "softmax", "log_softmax", "cross_entropy", "nll_loss", "exp", "expm1", "log", "log2", "log10", "log1p", "pow",
    "__pow__", "rsqrt", "reciprocal", "logsumexp", "cumsum", "cumprod", "prod", "sum", "layer_norm", "group_norm",
    "norm", "vector_norm", "matrix_norm", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "softplus",
    "binary_cross_entropy_with_logits", "kl_div", "cosine_similarity", "cdist", "dist", "renorm"})
OPT_DTYPE = frozenset({"sum", "cumsum", "cumprod", "prod", "softmax", "log_softmax"})  # fp32 via their dtype
_MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "convolution",
                         "_convolution", "convolution_backward", "cudnn_convolution"})
_NO_KERNEL_OPS = frozenset({"_unsafe_view", "_reshape_alias", "unsafe_split", "unsafe_chunk", "empty", "empty_like",
                            "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
                            "detach", "alias", "set_", "resize_", "sym_size", "sym_stride",
                            "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
                            "_record_function_enter_new", "_record_function_exit", "record_stream"})
_SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "equal"})


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
    sms: int = SMS

    @classmethod
    def for_mode(cls, mode: str, **fields) -> "Hardware":
        """The H100 with the per-launch cost of `mode` (`LAUNCH_S`) unless `launch_s` is given."""
        if mode not in LAUNCH_S:
            raise ValueError(f"unknown mode '{mode}': choose from {', '.join(MODES)}")
        return cls(**{"launch_s": LAUNCH_S[mode], **fields})

    def program_flops(self, programs: int) -> float:
        """The FLOP/s of a kernel of `programs` one-SM programs (the whole-sequence kernels, whose
        products run on the FMA units, bf16-rounded operands or not): the fp32 FMA peak times the
        share of the SMs it occupies."""
        return self.fp32_flops * min(programs, self.sms) / self.sms

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


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of t's elements, a broadcast (stride 0) dimension counted once."""
    count = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            count *= size
    return count * t.element_size()


@functools.cache
def _op_kind(func) -> str:
    """"view" / "free" (no kernel), "sync", "matmul", "attention", "multi" (multi-tensor), "kernel"."""
    name = func.overloadpacket.__name__
    if name in _SYNC_OPS:
        return "sync"
    returns = func._schema.returns
    if name in _NO_KERNEL_OPS or (returns and all(r.alias_info is not None and not r.alias_info.is_write
                                                  for r in returns)):
        return "free"
    if any(s in name for s in ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")):
        return "attention"
    if name in _MATMUL_OPS:
        return "matmul"
    if name.startswith("_foreach_") or name.startswith("_fused_"):
        return "multi"
    if func.namespace == "memory_kernels":
        return "memory_kernel"
    return "kernel"


def _bound_args(func, args, kwargs) -> dict:
    return {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs


def attention_flops(func, args, kwargs, density: float = 1.0) -> float:
    """A fused attention kernel's FLOPs: 4 B Hq Lq Lk D forward, 10 B Hq Lq Lk D backward
    (the scores recomputed), halved when causal, times the mask's density."""
    bound = _bound_args(func, args, kwargs)
    q, k = bound.get("query"), bound.get("key")
    if q is None or k is None:
        return 0.0
    b, h, lq, d = q.shape
    per = b * h * lq * k.shape[-2] * d
    flops = (10 if "backward" in func.overloadpacket.__name__ else 4) * per
    return flops * (0.5 if bound.get("is_causal") else 1.0) * density


def whole_sequence_kernel_cost(func, args, kwargs) -> tuple[float, float, int]:
    """(FLOPs, bytes, programs) of a whole-sequence kernel launch (`kernels.whole_sequence.kernel_cost`),
    from the custom op's named arguments."""
    bound = _bound_args(func, args, kwargs)
    q, first = bound["q"], bound["s1"] if "s1" in bound else bound["ck1"]
    batch, heads, chunks, chunk, dim = q.shape
    backward = func.overloadpacket.__name__.endswith("bwd")
    flops, nbytes = kernel_cost(batch, heads, chunks, chunk, dim, first.shape[-1], bound["ns_steps"],
                                bound["checkpoint_every"], backward)
    return flops, nbytes, batch * heads


def matmul_flops(func, args, kwargs, out) -> float:
    """torch's FlopCounterMode formula, except convolution_backward: torch's ignores groups
    (a depthwise conv's backward would count as a dense one); here each requested gradient
    (input, weight) costs the forward's FLOPs, which do count groups."""
    if func.overloadpacket.__name__ == "convolution_backward":
        bound = _bound_args(func, args, kwargs)
        forward = conv_flop_count(list(bound["input"].shape), list(bound["weight"].shape),
                                  list(bound["grad_output"].shape), bound["transposed"])
        return float(forward * sum(bool(m) for m in bound["output_mask"][:2]))
    counter = flop_registry.get(func.overloadpacket)
    return float(counter(*args, **kwargs, out_val=out)) if counter else 0.0


class _Recorder:
    """The state of one recording: phase, module stack, backward tag, autocast emulation,
    the open fused group of the compile model, the accumulated `StepCost`."""

    def __init__(self, cost: StepCost, bf16: bool, compiled: bool, compile_modules, compile_functions):
        self.cost = cost
        self.bf16 = bf16
        self.compiled = compiled
        self.compile_modules = compile_modules  # None: the whole model (when compiled)
        self.compile_functions = compile_functions
        self.phase = "forward"
        self.stack: list[Tag] = []
        self.backward_tag = Tag()
        self.attention_depth = 0
        self.attention_density = 1.0
        self.attention_label = ""
        self.autocast_off = 0
        self.cast_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.group: list | None = None  # the open fused run: [Tag, class, bytes of its largest op, ops]
        self._code_names: dict = {}
        self.memory_modules: dict[int, str] = {}  # id -> name of the model's memory modules (models/memory/)

    # --- context ---
    def _frames(self) -> tuple[set, bool, str, str]:
        """(names of model functions on the Python stack, whether a checkpoint recompute is
        running, the name of the innermost memory module whose method is on the stack (a
        memory's method called directly, such as MAC's `retrieve`, runs no forward hook), the
        innermost model function as "file.py:function")."""
        names, recompute, memory, innermost = set(), False, "", ""
        frame = sys._getframe(2)
        for _ in range(100):
            if frame is None:
                break
            code = frame.f_code
            hit = self._code_names.get(code)
            if hit is None:
                filename = code.co_filename
                if filename.startswith(_MODEL_DIRS):
                    method = filename.startswith(_MEMORY_DIR) and code.co_varnames[:1] == ("self",)
                    qualname = getattr(code, "co_qualname", code.co_name)
                    named = not code.co_name.startswith("<")  # a comprehension or lambda: its function's
                    hit = ("model", code.co_name, method, f"{os.path.basename(filename)}:{qualname}" if named else "")
                elif filename.endswith(os.path.join("utils", "checkpoint.py")):
                    hit = ("checkpoint", "", False, "")
                else:
                    hit = ("", "", False, "")
                self._code_names[code] = hit
            if hit[0] == "model":
                names.add(hit[1])
                innermost = innermost or hit[3]
                if hit[2] and not memory:
                    memory = self.memory_modules.get(id(frame.f_locals.get("self")), "")
            elif hit[0] == "checkpoint":
                recompute = True
            frame = frame.f_back
        return names, recompute, memory, innermost

    def tag_now(self) -> Tag:
        """The context of an op about to run: the innermost module's in forward (and in a
        module run again by a recompute), the running autograd node's in backward; the memory
        module, read or update, compiled regions and the model function from the Python stack
        (in backward only where model code runs: a recompute, a custom Function's backward)."""
        if self.stack:
            base = self.stack[-1]
        else:
            base = self.backward_tag if self.phase == "backward" else Tag()
        names, _, memory, function = self._frames()
        own = self.phase == "forward" or bool(names - {"backward"})  # model frames of this op's own
        if memory and not base.memory:
            base = Tag(base.module, memory, base.read, base.attention, base.compiled, base.function)
        read = bool(names & READ_FUNCTIONS) if base.memory and own else base.read
        compiled = base.compiled or bool(names & self.compile_functions)
        attention = base.attention or self.attention_depth > 0
        function = function if own and function else base.function
        if self.attention_depth and self.attention_label:
            function = self.attention_label
        if self.phase == "backward" and not own and function == base.function:
            return base
        return Tag(base.module, base.memory, read, attention, compiled, function)

    def push(self, name: str, module: torch.nn.Module) -> None:
        parent = self.stack[-1] if self.stack else Tag()
        memory = parent.memory
        if not memory and type(module).__module__.startswith("models.memory."):
            memory = name
        compiled = parent.compiled or (self.compiled and (self.compile_modules is None or name in self.compile_modules))
        self.stack.append(Tag(name, memory, parent.read, parent.attention, compiled, parent.function))

    def pop(self) -> None:
        if self.stack:
            self.stack.pop()

    def enter_node(self, tag: Tag, grad_outputs):
        self.backward_tag = tag

    def tag_outputs(self, out) -> None:
        """Tag the autograd nodes of a torch function's outputs with the context they were made in."""
        tag = None
        for t in _tensors(out):
            node = t.grad_fn
            if node is None or "step_cost" in node.metadata:
                continue
            tag = tag or self.tag_now()
            node.metadata["step_cost"] = tag
            node.register_prehook(functools.partial(self.enter_node, tag))

    @contextlib.contextmanager
    def attention(self, density: float = 1.0, label: str = ""):
        """Ops in the block are attention (`label`: the function they are booked under)."""
        self.attention_depth += 1
        before = self.attention_density, self.attention_label
        self.attention_density, self.attention_label = density, label or self.attention_label
        try:
            yield
        finally:
            self.attention_depth -= 1
            self.attention_density, self.attention_label = before

    @contextlib.contextmanager
    def no_autocast(self):
        self.autocast_off += 1
        try:
            yield
        finally:
            self.autocast_off -= 1

    def autocast_active(self) -> bool:
        if not self.bf16 or self.autocast_off or self.phase == "optimizer":
            return False
        return self.phase == "forward" or self._frames()[1]

    def cast(self, args, kwargs, dtype: torch.dtype, lower_only: bool):
        """args, kwargs with floating tensors cast to dtype as autocast would (fp32 / fp16 to
        bf16; with `lower_only`, bf16 / fp16 to fp32), a leaf parameter once per forward."""

        def one(t):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
                return t
            if lower_only and t.dtype not in (torch.bfloat16, torch.float16):
                return t
            cacheable = self.phase == "forward" and t.is_leaf and t.requires_grad
            if cacheable and id(t) in self.cast_cache and self.cast_cache[id(t)][0] is t:
                return self.cast_cache[id(t)][1]
            cast = t.to(dtype)
            if cacheable:
                self.cast_cache[id(t)] = (t, cast)
            return cast

        def walk(x):
            if isinstance(x, (list, tuple)) and any(isinstance(i, torch.Tensor) for i in x):
                return type(x)(one(i) for i in x)
            return one(x)

        return tuple(walk(a) for a in args), {k: walk(v) for k, v in kwargs.items()}

    # --- costing ---
    def classify(self, tag: Tag, kind: str) -> str:
        if self.phase == "optimizer":
            return "optimizer"
        if kind == "attention" or tag.attention:
            return "attention"
        if tag.memory:
            return "memory read" if tag.read else "memory update"
        return "decoder matmuls" if kind == "matmul" else "elementwise"

    def _book(self, name: str, cls: str, tag: Tag, cost: Cost, fp32_matmul: bool) -> None:
        function = "(optimizer)" if self.phase == "optimizer" else tag.function or "(outside models/, kernels/)"
        self.cost.classes[cls].add(cost)
        self.cost.ops.setdefault((cls, name), Cost()).add(cost)
        self.cost.functions.setdefault(function, Cost()).add(cost)
        if fp32_matmul:
            self.cost.fp32_matmul.add(cost)
            self.cost.fp32_functions[function] = self.cost.fp32_functions.get(function, 0) + cost.launches
        if tag.memory and cls != "optimizer":
            counts = self.cost.memory_layers.setdefault(tag.memory, [0, 0])
            counts[self.phase != "forward"] += cost.launches

    def close_group(self) -> None:
        if self.group is None:
            return
        tag, cls, nbytes, count = self.group
        self.group = None
        hw = self.cost.hardware
        self._book("fused group (compiled region)", cls, tag,
                   Cost(1, 0.0, nbytes, nbytes / hw.bytes_per_s, hw.launch_s), False)

    def account(self, func, kind: str, args, kwargs, out) -> None:
        inputs = {id(t): t for t in _tensors((args, kwargs))}
        outputs = _tensors(out)
        if not any(t.device.type == "meta" for t in (*inputs.values(), *outputs)):
            return  # host-side tensors (CPU scalars): no kernel on the device
        if outputs and all(t.numel() == 0 for t in outputs):
            return  # nothing to compute (an empty stream buffer): CUDA returns before launching
        hw = self.cost.hardware
        tag = self.tag_now()
        cls = self.classify(tag, kind)
        nbytes = sum(tensor_bytes(t) for t in inputs.values()) + sum(tensor_bytes(t) for t in outputs)
        if kind == "kernel" and tag.compiled and self.phase != "optimizer":
            if self.group is not None and self.group[0].memory == tag.memory and self.group[1] == cls:
                self.group[2] = max(self.group[2], nbytes)
                self.group[3] += 1
            else:
                self.close_group()
                self.group = [tag, cls, nbytes, 1]
            return
        self.close_group()
        flops, dtype = 0.0, None
        if kind == "attention":
            flops = attention_flops(func, args, kwargs, self.attention_density)
            dtype = next((t.dtype for t in inputs.values() if t.is_floating_point()), None)
        elif kind == "matmul":
            flops = matmul_flops(func, args, kwargs, out)
            dtype = next((t.dtype for t in inputs.values() if t.is_floating_point()), None)
        launches = 1
        if kind == "memory_kernel":  # kernels/whole_sequence.py: one launch of (batch x heads) programs
            flops, nbytes, programs = whole_sequence_kernel_cost(func, args, kwargs)
            compute = max(flops / hw.program_flops(programs), nbytes / hw.bytes_per_s)
            self._book(func.overloadpacket.__name__, cls, tag, Cost(1, flops, nbytes, compute, hw.launch_s), False)
            return
        if kind == "multi":
            lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
            n = max((len(a) for a in lists), default=1)
            elements = sum(t.numel() for t in lists[0]) if lists else 0
            launches = max(1, math.ceil(n / MULTI_TENSOR_LIST), math.ceil(elements / MULTI_TENSOR_ELEMENTS))
        compute = max(flops / hw.peak(dtype) if flops else 0.0, nbytes / hw.bytes_per_s)
        self._book(func.overloadpacket.__name__, cls, tag,
                   Cost(launches, flops, nbytes, compute, launches * hw.launch_s), flops > 0 and dtype == torch.float32)

    def sync(self, func, args, kwargs):
        """Count a host sync; answer it with a placeholder (meta has no values)."""
        self.close_group()
        name = func.overloadpacket.__name__
        self.cost.syncs += 1
        self.cost.sync_ops[name] = self.cost.sync_ops.get(name, 0) + 1
        first = args[0] if args else None
        if name == "_local_scalar_dense":
            return False if first.dtype == torch.bool else (0.0 if first.is_floating_point() else 0)
        if name == "equal":
            return True
        if name == "nonzero":
            return torch.empty((0, first.dim()), dtype=torch.long, device=first.device)
        return first.new_empty((0,))


class _DispatchMode(TorchDispatchMode):
    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.rec = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _op_kind(func)
        if kind == "sync" and any(t.device.type == "meta" for t in _tensors(args)):
            return self.rec.sync(func, args, kwargs)
        if func.overloadpacket.__name__ in ("_to_copy", "copy_"):
            src = args[1] if func.overloadpacket.__name__ == "copy_" else args[0]
            dst = kwargs.get("device") if func.overloadpacket.__name__ == "_to_copy" else args[0].device
            if src.device.type == "meta" and dst is not None and torch.device(dst).type == "cpu":
                self.rec.sync(func, args, kwargs)
                return torch.empty(src.shape, dtype=kwargs.get("dtype") or src.dtype, device="cpu") \
                    if func.overloadpacket.__name__ == "_to_copy" else args[0]
        out = func(*args, **kwargs)
        if kind not in ("free", "sync"):
            self.rec.account(func, kind, args, kwargs, out)
        return out


class _FunctionMode(TorchFunctionMode):
    """bf16 autocast emulation, CUDA kernel choices (SDPA, RMSNorm) and autograd-node tagging."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.rec = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        name = getattr(func, "__name__", "")
        active = rec.autocast_active() if (name in LOWER_PRECISION or name in FULL_PRECISION) else False
        if active and name in LOWER_PRECISION:
            args, kwargs = rec.cast(args, kwargs, torch.bfloat16, lower_only=False)
        elif active and name in OPT_DTYPE:  # autocast passes dtype=float32 for a lower-precision input
            if kwargs.get("dtype") is None and any(t.dtype in (torch.bfloat16, torch.float16) for t in _tensors(args)):
                kwargs = {**kwargs, "dtype": torch.float32}
        elif active and name in FULL_PRECISION:
            args, kwargs = rec.cast(args, kwargs, torch.float32, lower_only=True)
        if name == "scaled_dot_product_attention":
            out = _cuda_sdpa(rec, *args, **kwargs)
        elif name == "rms_norm":
            out = _fused_rms_norm(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        rec.tag_outputs(out)
        return out


def _cuda_sdpa(rec: _Recorder, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as the CUDA dispatcher runs it: flash attention (bf16 / fp16, no mask; GQA native),
    else memory-efficient attention with the mask as an additive bias."""
    with rec.attention(rec.attention_density):
        if attn_mask is None and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                      scale=scale)[0]
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill(~bias, float("-inf"))
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p, is_causal,
                                                                      scale=scale)[0]


def _fused_rms_norm(func, args, kwargs):
    """F.rms_norm as torch's one-kernel CUDA RMSNorm (`_fused_rms_norm`, forward and backward)."""
    names = ("input", "normalized_shape", "weight", "eps")
    bound = dict(zip(names, args)) | kwargs
    x, weight, eps = bound["input"], bound.get("weight"), bound.get("eps")
    if weight is not None and weight.dtype != x.dtype:
        return func(*args, **kwargs)
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return torch.ops.aten._fused_rms_norm(x, list(bound["normalized_shape"]), weight, eps)[0]


def _eager_flex_attention(rec: _Recorder, compiled_region: bool):
    """`models.layers.attention.masked_attention` as on CUDA: flex attention, eager (torch's
    unfused math path) or, inside a compiled region, one fused kernel."""

    def attention(q, k, v, mask_mod, scale=None, block_mask=None):
        from torch._higher_order_ops.flex_attention import math_attention
        from torch.nn.attention.flex_attention import create_block_mask

        scale = q.shape[-1] ** -0.5 if scale is None else scale
        tag = rec.stack[-1] if rec.stack else Tag()
        if compiled_region and tag.compiled:
            try:
                rows, cols = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
                density = float(mask_mod(rows, cols).float().mean())
            except Exception:
                density = 1.0
            with rec.attention(density, "attention.py:masked_attention (compiled flex)"):
                return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[0]
        with rec.attention(label="attention.py:masked_attention (eager flex)"):
            if block_mask is None:
                block_mask = create_block_mask(lambda b, h, qi, ki: mask_mod(qi, ki), None, None, q.shape[2],
                                               k.shape[2], device=q.device)
            out, _, _ = math_attention(q, k, v, lambda score, b, h, m, n: score, block_mask.as_tuple(), scale, {})
        return out

    return attention


@contextlib.contextmanager
def _rebound(original, replacement):
    """Replace `original` by `replacement` wherever a project module (models, kernels,
    torchtitan_ext) bound it, for the duration of the block."""
    changed = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("models", "kernels", "torchtitan_ext")):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                changed.append((module, attr))
                setattr(module, attr, replacement)
    try:
        yield
    finally:
        for module, attr in changed:
            setattr(module, attr, original)


@contextlib.contextmanager
def _cuda_paths(rec: _Recorder):
    """The CUDA branches the meta device would not take (module docstring)."""
    import kernels.token_step
    import models.layers.attention
    import models.layers.tracing

    def full_precision(device):
        return rec.no_autocast()

    with contextlib.ExitStack() as stack:
        stack.enter_context(_rebound(kernels.token_step.full_precision, full_precision))
        stack.enter_context(_rebound(models.layers.attention.masked_attention,
                                     _eager_flex_attention(rec, rec.compiled)))
        stack.enter_context(_rebound(models.layers.attention.flex_block_mask, models.layers.attention._block_mask))
        stack.enter_context(_rebound(models.layers.tracing.compiling, lambda: rec.tag_now().compiled))
        yield


class FusedAdamW:
    """torch's fused AdamW step (`torch.optim.AdamW(fused=True)`, what bench_models.py runs on
    CUDA) on meta tensors, which torch.optim refuses: `_foreach_add_` on the step counters,
    then one `_fused_adamw_` per parameter dtype. State is made before the step is recorded
    (it exists after the first step)."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.state = {id(p): (torch.zeros_like(p), torch.zeros_like(p), torch.zeros((), device=p.device))
                      for p in self.params}

    def step(self) -> None:
        groups: dict = {}
        for p in self.params:
            if p.grad is not None:
                groups.setdefault((p.device, p.dtype), []).append(p)
        for params in groups.values():
            exp_avg, exp_avg_sq, steps = zip(*(self.state[id(p)] for p in params))
            torch._foreach_add_(list(steps), 1)
            torch._fused_adamw_(params, [p.grad for p in params], list(exp_avg), list(exp_avg_sq), [], list(steps),
                                lr=self.lr, beta1=self.betas[0], beta2=self.betas[1], weight_decay=self.weight_decay,
                                eps=self.eps, amsgrad=False, maximize=False)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def _backward(loss: torch.Tensor) -> None:
    """loss.backward() straight into the autograd engine: `Tensor.backward` is a torch function,
    and the TorchFunctionMode that handles it would be off for the whole backward (the
    recompute of checkpointed chunks would then run without the autocast emulation)."""
    from torch.autograd import Variable

    grad = torch.ones((), dtype=loss.dtype, device=loss.device)
    Variable._execution_engine.run_backward((loss,), (grad,), False, False, (), allow_unreachable=True,
                                            accumulate_grad=True)


def record_step(model: torch.nn.Module, loss_fn, *, optimizer=None, tokens: int = 0, bf16: bool = True,
                compiled: bool = False, compile_modules=None, compile_functions=frozenset(),
                hardware: Hardware = Hardware()) -> StepCost:
    """Record and cost one training step of `model` (on the meta device): loss_fn(model) ->
    loss (forward), loss.backward(), optimizer.step() (default `FusedAdamW` over the model's
    parameters), zero_grad. bf16: emulate CUDA bf16 autocast over the forward. compiled: the
    compile model (module docstring) over `compile_modules` (names of submodules compiled as
    regions, as `model.named_modules()` names them; None: the whole model) and
    `compile_functions` (model functions compiled);
    functions in CUDA_COMPILED_FUNCTIONS are a compiled region in any case."""
    devices = {p.device.type for p in model.parameters()}
    if devices != {"meta"}:
        raise ValueError(f"record_step runs on the meta device: the model's parameters are on {sorted(devices)}")
    optimizer = optimizer if optimizer is not None else FusedAdamW(model.parameters())
    cost = StepCost(hardware, tokens=tokens, device="meta")
    functions = CUDA_COMPILED_FUNCTIONS | (frozenset(compile_functions) if compiled else frozenset())
    rec = _Recorder(cost, bf16, compiled, compile_modules, functions)
    handles = []
    rec.memory_modules = {id(m): name for name, m in model.named_modules()
                          if type(m).__module__.startswith("models.memory.")}
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, args, name=name: rec.push(name, m)))
        handles.append(module.register_forward_hook(lambda m, args, out: rec.pop()))
    start = time.perf_counter()
    try:
        with _cuda_paths(rec), _FunctionMode(rec), _DispatchMode(rec), warnings.catch_warnings():
            # torch's note that rms_norm with a bf16 input and an fp32 weight takes the unfused path (so on CUDA)
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            loss = loss_fn(model)
            rec.close_group()
            rec.phase, rec.stack, rec.cast_cache = "backward", [], {}
            _backward(loss)
            rec.close_group()
            rec.phase = "optimizer"
            optimizer.step()
            optimizer.zero_grad()
            rec.close_group()
    except Exception as e:
        if cost.syncs:  # a placeholder steered the step: its control flow needs tensor values
            raise RuntimeError(f"the step cannot be recorded on meta: it read {cost.syncs} tensor value(s) on the "
                               f"host ({cost.sync_ops}), answered with placeholders, and then failed: {e}") from e
        raise
    finally:
        for handle in handles:
            handle.remove()
    cost.record_s = time.perf_counter() - start
    return cost


# --- the families, as scripts/bench_models.py builds and trains them ---

def parse_config(text: str) -> tuple[str, str]:
    """"titans_mac_400m" / "titans_mac:400m" -> ("titans_mac", "400m"): the longest model name
    (`<family>[_<variant>]`) whose family has the rest as a flavor."""
    if ":" in text:
        name, flavor = text.split(":", 1)
        return name, flavor
    parts = text.split("_")
    for cut in range(len(parts) - 1, 0, -1):
        name, flavor = "_".join(parts[:cut]), "_".join(parts[cut:])
        try:
            family, _ = family_and_overrides(name)
        except ValueError:
            continue
        if flavor in family.flavors:
            return name, flavor
    raise ValueError(f"config '{text}': no <family>[_<variant>]_<flavor> of the registry "
                     "(e.g. titans_mac_400m, transformer_400m, mela_400m)")


@dataclass
class Prediction:
    name: str
    flavor: str
    batch: int
    seq_len: int
    mode: str
    params: int
    flops_per_token: float
    cost: StepCost
    compiled_modules: tuple[str, ...] = ()  # what the recipe compiles (mode compiled or graphs)

    @property
    def compiled(self) -> bool:
        return self.mode != "eager"

    @property
    def mfu(self) -> float:
        return self.cost.tokens_per_s * self.flops_per_token / self.cost.hardware.bf16_flops


def predict(config: str, *, seq_len: int = 4096, batch: int = 2, mode: str = "eager",
            hardware: Hardware | None = None, whole_sequence: bool = False) -> Prediction:
    """Record one bench_models.py training step of CONFIG (e.g. "titans_mac_400m") on meta
    and cost it on an H100 (`whole_sequence`: every neural memory on the whole-sequence kernels).
    mode (`MODES`): "eager"; "compiled", as the family's training compiles (`Family.compiled_module_names`:
    torchtitan's per-block compile of `layers`, or the family's regions; Titans on the chunk
    loop also compiles its chunk step), every other module eager; "graphs", compiled so and the
    whole step replayed as one CUDA graph. `hardware` (default `Hardware.for_mode(mode)`)."""
    if mode not in LAUNCH_S:
        raise ValueError(f"unknown mode '{mode}': choose from {', '.join(MODES)}")
    name, flavor = parse_config(config)
    family = family_and_overrides(name)[0]
    with torch.device("meta"):
        model, cfg, flops_per_token = plain_step.build(name, flavor)
    if whole_sequence and not use_whole_sequence(model):
        raise ValueError(f"--whole-sequence: {config} has no neural memory")
    seq_len = plain_step.fitted_length(cfg, seq_len)
    hardware = hardware or Hardware.for_mode(mode)
    data = plain_step.inputs(family.name, batch, seq_len, cfg.vocab_size, "meta")
    compiled = mode != "eager"
    compile_modules = tuple(family.compiled_module_names(model)) if compiled else ()
    chunk_loop = family.name == "titans" and not whole_sequence  # its compile_regions compiles the chunk step
    model.train()
    cost = record_step(model, lambda m: plain_step.loss_of(m, data), tokens=batch * seq_len, bf16=True,
                       compiled=compiled, compile_modules=frozenset(compile_modules),
                       compile_functions=CHUNK_STEP_FUNCTIONS if chunk_loop else frozenset(), hardware=hardware)
    return Prediction(name, flavor, batch, seq_len, mode, sum(p.numel() for p in model.parameters()),
                      flops_per_token(seq_len), cost, compile_modules)


def baseline_of(p: Prediction) -> str | None:
    """The Transformer++ config a prediction is compared with: transformer_<flavor> where that
    flavor exists (transformer_400m beside titans_mac_400m), else None."""
    family = family_and_overrides("transformer")[0]
    return f"transformer_{p.flavor}" if p.name != "transformer" and p.flavor in family.flavors else None


MODE_TEXT = {"eager": "eager", "compiled": "compiled as its training compiles (crude fusion model)",
             "graphs": "compiled as its training compiles (crude fusion model), replayed as a CUDA graph"}


def report(p: Prediction, top: int = 12, baseline: Prediction | None = None) -> str:
    """The printed tables: by class, the step, launches per memory layer, top ops, the
    `baseline` (the Transformer++ in the same mode) beside it, and the lease's measurement
    where one exists for this shape."""
    c, hw = p.cost, p.cost.hardware
    fp32 = f"TF32 {hw.tf32_flops / 1e12:.0f}" if hw.tf32 else f"fp32 {hw.fp32_flops / 1e12:.0f} (allow_tf32=False)"
    lines = [
        f"{p.name} {p.flavor}: {p.params / 1e6:.1f}M params, batch {p.batch} x seq {p.seq_len}, bf16 autocast "
        f"(fp32 params), {MODE_TEXT[p.mode]}, fused AdamW; recorded on {c.device} in {c.record_s:.1f} s",
        f"H100 model: bf16 {hw.bf16_flops / 1e12:.0f} TFLOP/s, fp32 matmuls at {fp32} TFLOP/s, HBM "
        f"{hw.bytes_per_s / 1e12:.2f} TB/s, launch floor {hw.launch_s * 1e6:.1f} us, host sync "
        f"{hw.sync_s * 1e6:.0f} us",
        f"{'class':<16} {'launches':>9} {'GFLOPs':>10} {'GB moved':>9} {'roofline ms':>12} {'floor ms':>9} "
        f"{'pred ms':>9} {'share':>6}",
    ]
    total = c.total
    for name, cost in list(c.classes.items()) + [("total", total)]:
        share = cost.seconds / c.step_s if c.step_s else 0.0
        lines.append(f"{name:<16} {cost.launches:>9,} {cost.flops / 1e9:>10,.1f} {cost.bytes / 1e9:>9,.2f} "
                     f"{cost.compute_s * 1e3:>12,.2f} {cost.launch_s * 1e3:>9,.2f} {cost.seconds * 1e3:>9,.2f} "
                     f"{share:>6.1%}")
    syncs = ", ".join(f"{k} {v}" for k, v in sorted(c.sync_ops.items())) or "none"
    lines.append(f"host syncs: {c.syncs} ({syncs}) = {c.sync_s * 1e3:.2f} ms")
    where = ", ".join(f"{k} {v:,}" for k, v in sorted(c.fp32_functions.items(), key=lambda kv: -kv[1]))
    lines.append(f"fp32 matmuls: {c.fp32_matmul.launches:,} launches, {c.fp32_matmul.flops / 1e9:,.1f} GFLOPs, "
                 f"{c.fp32_matmul.compute_s * 1e3:.2f} ms roofline{f' ({where})' if where else ''}")
    lines.append(f"predicted step {c.step_s * 1e3:,.1f} ms -> {c.tokens_per_s:,.0f} tokens/s; MFU {p.mfu:.1%} "
                 f"(bench_models.py's FLOPs/token {p.flops_per_token / 1e9:.2f} G)")
    if c.memory_layers:
        layers = list(c.memory_layers.items())
        first, (fwd, bwd) = layers[0]
        mean = sum(f + b for f, b in c.memory_layers.values()) / len(layers)
        lines.append(f"launches per memory layer: {first}: {fwd + bwd:,} (forward {fwd:,}, backward {bwd:,} incl. "
                     f"recompute); mean over {len(layers)} memory modules {mean:,.0f}")
    lines.append("top ops by predicted time (class / aten op):")
    for (cls, name), cost in sorted(c.ops.items(), key=lambda kv: -kv[1].seconds)[:top]:
        lines.append(f"  {cls + ' / ' + name:<44} {cost.launches:>8,} launches {cost.flops / 1e9:>9,.1f} GFLOPs "
                     f"{cost.bytes / 1e9:>7,.2f} GB {cost.seconds * 1e3:>8,.2f} ms ({cost.launch_s * 1e3:,.2f} floor)")
    lines.append("top model functions by predicted time (forward op's function; backward ops take their node's):")
    for function, cost in sorted(c.functions.items(), key=lambda kv: -kv[1].seconds)[:top]:
        lines.append(f"  {function:<44} {cost.launches:>8,} launches {cost.flops / 1e9:>9,.1f} GFLOPs "
                     f"{cost.bytes / 1e9:>7,.2f} GB {cost.seconds * 1e3:>8,.2f} ms ({cost.launch_s * 1e3:,.2f} floor)")
    if p.compiled:
        lines.insert(2, f"compiled regions ({len(p.compiled_modules)}): {', '.join(p.compiled_modules[:4])}"
                        f"{', ...' if len(p.compiled_modules) > 4 else ''}; every other module eager")
    if baseline is not None:
        b = baseline.cost
        lines.append(f"beside {baseline.name} {baseline.flavor} (same mode and shape): {b.total.launches:,} launches, "
                     f"{b.tokens_per_s:,.0f} tokens/s; {p.name} / {baseline.name}: {c.total.launches / b.total.launches:.1f}x "
                     f"the launches, {c.tokens_per_s / b.tokens_per_s:.2f}x the tokens/s")
    measured = MEASURED_H100.get((p.name, p.flavor, p.mode))
    if measured and (p.batch, p.seq_len) == MEASURED_SHAPE:
        tokens_s, mfu = measured
        step = p.batch * p.seq_len / tokens_s
        per_launch = (step - c.total.compute_s - c.sync_s) / max(total.launches, 1)
        flop_s = sum(cost.compute_s for cost in c.ops.values() if cost.flops)
        room = step - (c.step_s - flop_s)
        efficiency = f"{flop_s / room:.0%}" if room > 0 else "none (the rest alone exceeds it)"
        lines.append(f"lease (H100, bench_models.py): {tokens_s:,} tokens/s = {step * 1e3:,.1f} ms/step"
                     f"{f', MFU {mfu}%' if mfu else ''}; predicted / measured {c.tokens_per_s / tokens_s:.2f}x")
        lines.append(f"  the measured step fits this model with {per_launch * 1e6:.1f} us per launch (FLOP-bearing "
                     f"ops at peak), or with the FLOP-bearing ops at {efficiency} of peak ({hw.launch_s * 1e6:.1f} us "
                     f"per launch)")
    return "\n".join(lines)
