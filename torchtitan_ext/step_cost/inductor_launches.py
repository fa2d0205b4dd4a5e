"""Launches of one training step as Inductor's GPU scheduling emits them, counted on a CPU (issue 47).

`step_cost`'s compiled mode models Inductor's fusion crudely (every run of non-matmul ops between
two matmuls one kernel). This module counts what Inductor itself emits. Inductor's CPU device can
be lowered with the Triton scheduling a GPU uses (`torch._inductor.config.cpu_backend = "triton"`:
the same fusion rules, the same concatenation, reduction and scan kernels), and the wrapper module it
writes for each graph lists every launch of the graph in order: a Triton kernel (`name.run(`), an
extern kernel (`extern_kernels.mm(`: cuBLAS on a GPU), a fallback op (`torch.ops.<op>(`: the memory
kernels, attention). Without a GPU the Triton kernels cannot be compiled, so the wrapper is read
before Inductor loads it and the graph then runs eagerly (AOTAutograd's own partition of forward and
backward and Inductor's decompositions, so the step's values are eager's, up to the whole-sequence
memory kernels, which are counted and not run: `_memory_kernels_unrun`).

`count_twin` trains one step of a config's *launch twin* (`launch_twin`: the flavor's depth and its
ratios of sequence length to windows, segments and chunks, at width 32 and a sequence shortened by
the same factor, so every loop over segments, chunks and layers keeps its trip count) on the CPU,
bf16 autocast over the forward and fused AdamW as scripts/bench_models.py on a GPU, its modules
compiled as the family's training compiles them (`Family.compile`), after one warm-up step that
compiles every graph, and counts every call of a compiled graph: its wrapper's launches (one graph
shared by 19 blocks counts 19 times). What runs outside compiled graphs is not counted here:
`prediction.Prediction.launches` adds step_cost's eager count of it. `count_compiled` extrapolates
the twin's count to the flavor's depth from two shallow twins.

Where a GPU step differs (stated, not modelled):
- attention takes the model's CPU branch where it has one (`masked_attention`: SDPA with a dense
  mask, one op forward, one backward beside its pointwise preparation; CUDA runs compiled flex
  attention: one template kernel forward, a template and a preparation kernel backward);
- Inductor's choices that depend on sizes follow the twin's (a reduction split in two at the
  paper's width is one kernel at 32);
- a graph the CPU run breaks where CUDA would not (none seen) would lose the ops between its parts
  from the count (they run neither in a compiled graph nor outside the recipe's regions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections import Counter
from unittest import mock
from dataclasses import dataclass, field

import torch


TWIN_WIDTH = 32  # the twin's model width (heads of 16: two heads, one key/value head where the flavor groups them)
TWIN_VOCAB = 64
# What the twin shortens, per family, with the sequence: the fields holding lengths, divided by the same factor.
TWIN_LENGTHS = {"titans": ("window",), "mela": ("patch_size",), "transformer": (), "mlp_lm": ()}
TWIN_MEMORY_CHUNK = 4  # Titans: the twin's memory chunk (the factor is the flavor's chunk / this)
TWIN_FACTOR = 16  # the factor where no chunk sets it (Transformer++: only its trip counts matter)
WRAPPERS_ENV = "STEP_COST_WRAPPERS"  # a folder: every graph's wrapper source written there (NNN_forward.py, ...)

_LAUNCH_LINE = re.compile(r"^\s*(?:(?P<triton>\w+)\.run\(|.*?extern_kernels\.(?P<extern>\w+)\("
                          r"|.*?torch\.ops\.(?P<op>[\w.]+)\()")


def wrapper_launches(source: str) -> Counter:
    """The launches of one Inductor wrapper module's `call`, in kinds: "triton" (a generated
    kernel), "extern <op>" (a library kernel: mm, bmm, addmm, ...), "op <namespace.op>" (a fallback
    op: the memory kernels, attention). Each is one launch on a GPU (the custom ops launch nothing
    besides their kernel: tests/test_whole_sequence.py)."""
    body = source[source.index("def call(") :]
    body = body.split("\nrunner = ", 1)[0]
    counts = Counter()
    for line in body.splitlines():
        match = _LAUNCH_LINE.match(line)
        if match is None or line.lstrip().startswith("#"):
            continue
        if match["triton"]:
            counts["triton"] += 1
        elif match["extern"]:
            counts[f"extern {match['extern']}"] += 1
        else:
            counts[f"op {match['op'].rsplit('.', 1)[0] if match['op'].endswith('.default') else match['op']}"] += 1
    return counts


class _Captured(Exception):
    """Raised in place of loading a wrapper module: its source is read, its kernels never compiled."""


# Lowerings that take another branch on a CPU device than on a GPU, whatever the backend: torch 2.13 lowers
# every concatenation on a CPU as a ConcatKernel (a copy kernel per input that cannot be computed into the
# output), where a GPU may lower it as one pointwise kernel, and declines pad-as-cat on a CPU for that reason.
_GPU_BRANCHES = ("cat", "_pad_as_cat")


@contextlib.contextmanager
def _as_on_a_gpu():
    """`_GPU_BRANCHES` take their GPU branch for CPU tensors: their code's "cpu" literal swapped for a
    device name no tensor has (each function's own code only; restored after)."""
    import inspect

    from torch._inductor import lowering

    functions = [inspect.unwrap(getattr(lowering, name)) for name in _GPU_BRANCHES]  # `cat` is registered wrapped
    saved = [f.__code__ for f in functions]
    for f, code in zip(functions, saved):
        if "cpu" not in code.co_consts:
            raise RuntimeError(f"torch._inductor.lowering.{f.__name__} has no CPU branch to swap: this torch's "
                               "lowering differs from 2.13's, check _GPU_BRANCHES")
        f.__code__ = code.replace(co_consts=tuple("no-such-device" if c == "cpu" else c for c in code.co_consts))
    try:
        yield
    finally:
        for f, code in zip(functions, saved):
            f.__code__ = code


@contextlib.contextmanager
def _triton_scheduling(sources: list[str]):
    """Inductor lowers CPU graphs with its Triton (GPU) scheduling and the GPU branches of
    `_GPU_BRANCHES`; each wrapper module's source is appended to `sources` and `_Captured` raised
    instead of loading it (its Triton kernels would need a GPU driver; the driver's hash, asked for
    in kernels' metadata, is a stand-in)."""
    import torch._inductor.config as inductor_config
    import torch.utils._triton as triton_utils
    from torch._inductor.codecache import PyCodeCache

    load = PyCodeCache.load_by_key_path

    def read_wrapper(key, path, *args, **kwargs):
        with open(path) as f:
            source = f.read()
        if "def call(" not in source:
            return load(key, path, *args, **kwargs)
        sources.append(source)
        raise _Captured()

    with inductor_config.patch(cpu_backend="triton"), \
            mock.patch.object(triton_utils, "triton_hash_with_backend", lambda: "no-gpu-driver"), \
            mock.patch.object(triton_utils, "triton_backend", lambda: None), \
            mock.patch.object(PyCodeCache, "load_by_key_path", staticmethod(read_wrapper)), _as_on_a_gpu():
        yield


def _lowered_launches(gm: torch.fx.GraphModule, example_inputs, backward: bool) -> Counter:
    """The launches Inductor's Triton scheduling emits for one partitioned graph."""
    from torch._inductor.compile_fx import compile_fx_inner

    sources: list[str] = []
    with _triton_scheduling(sources):
        try:
            compile_fx_inner(gm, example_inputs, is_backward=backward)
        except Exception as e:  # Inductor wraps what the loader raised
            if not sources or not _caused_by_capture(e):
                raise
    if len(sources) != 1:
        raise RuntimeError(f"expected one Inductor wrapper for the graph, read {len(sources)}")
    folder = os.environ.get(WRAPPERS_ENV)
    if folder:  # each graph's wrapper kept, to read which kernels a launch count holds
        os.makedirs(folder, exist_ok=True)
        index = len(os.listdir(folder))
        with open(os.path.join(folder, f"{index:03d}_{'backward' if backward else 'forward'}.py"), "w") as f:
            f.write(sources[0])
    return wrapper_launches(sources[0])


def _caused_by_capture(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, _Captured):
            return True
        e = e.__cause__ or e.__context__
    return False


class _UnrunKernel:
    """A stand-in for one of kernels/whole_sequence_triton.py's kernels: `kernel[grid](...)` launches
    nothing (the op's outputs stay as allocated) and counts the call in `calls`."""

    def __init__(self):
        self.calls = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls += 1

        return launch


@contextlib.contextmanager
def _memory_kernels_unrun():
    """The whole-sequence memory ops (`memory_kernels::whole_sequence_fwd` / `_bwd`: opaque to
    torch.compile, one launch each wherever they run), and the op preparing their inputs
    (`memory_inputs::chunk_inputs` and its backward's `chunk_inputs_grads`), taken on a CPU and their Triton programs not run: a launch
    count needs none of their values, and the interpreter would spend minutes a layer on them.
    Their outputs are uninitialised, so the step's values are meaningless past them. Yields the
    forward kernel's stand-in (its `calls`: how often the whole-sequence path was taken)."""
    from kernels import memory_inputs, whole_sequence

    forward = _UnrunKernel()
    unrun = type("UnrunKernels", (), {"whole_sequence_fwd": forward, "whole_sequence_bwd": _UnrunKernel()})
    unrun_inputs = type("UnrunKernels", (), {"chunk_inputs_fwd": _UnrunKernel(), "chunk_inputs_bwd": _UnrunKernel()})
    with mock.patch.object(whole_sequence, "_kernels", unrun()), \
            mock.patch.object(memory_inputs, "_kernels", unrun_inputs()), \
            mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):  # `refusal` takes CPU inputs under the interpreter
        yield forward


@dataclass
class LaunchCount:
    """The launches of one step's compiled graphs: by launch kind (`wrapper_launches`), every call
    counted; the graphs compiled (forward and backward wrappers) and their calls."""

    launches: Counter = field(default_factory=Counter)
    graphs: int = 0
    calls: int = 0

    @property
    def total(self) -> int:
        return sum(self.launches.values())


class _Counting:
    """The counting state: on (`counting`), the count so far."""

    def __init__(self):
        self.count = LaunchCount()
        self.counting = False


def counting_backend(state: _Counting):
    """A torch.compile backend (AOTAutograd, Inductor's partition and decompositions): each forward
    and backward graph lowered once by Inductor's Triton scheduling (`_lowered_launches`), then run
    eagerly; while `state.counting`, every call adds its launches to `state.count`."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    def compiler(backward: bool):
        def compile_graph(gm, example_inputs):
            launches = _lowered_launches(gm, example_inputs, backward)
            state.count.graphs += 1
            run = make_boxed_func(gm.forward)

            def counted(args):
                if state.counting:
                    state.count.launches.update(launches)
                    state.count.calls += 1
                return run(args)

            counted._boxed_call = True
            return counted

        return compile_graph

    return aot_autograd(fw_compiler=compiler(False), bw_compiler=compiler(True),
                        partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())


def launch_twin(name: str, flavor: str, seq_len: int, depth: int | None = None):
    """(model, its config, twin sequence length, factor) of config `name`_`flavor` at TWIN_WIDTH:
    the flavor's depth (or `depth` decoder layers), its ratios of `seq_len` to the lengths of
    TWIN_LENGTHS (and Titans' memory chunk) kept, every length divided by one factor (Titans: its
    memory chunk / TWIN_MEMORY_CHUNK; Mela: its patch, to 1; else TWIN_FACTOR)."""
    from torchtitan_ext import plain_step
    from torchtitan_ext.families import family_and_overrides

    family = family_and_overrides(name)[0]
    if family.name not in TWIN_LENGTHS:
        raise ValueError(f"no launch twin for family '{family.name}': count one of {sorted(TWIN_LENGTHS)}")
    with torch.device("meta"):
        _, cfg, _ = plain_step.build(name, flavor)
    seq_len = plain_step.fitted_length(cfg, seq_len)
    if family.name == "titans":
        factor = cfg.memory.chunk_size // TWIN_MEMORY_CHUNK
    elif family.name == "mela":
        factor = cfg.patch_size
    else:
        factor = TWIN_FACTOR
    lengths = {f: getattr(cfg, f) for f in TWIN_LENGTHS[family.name]}
    if factor < 1 or seq_len % factor or any(v % factor for v in lengths.values()):
        raise ValueError(f"{name}_{flavor}: seq_len {seq_len} and {lengths} do not divide by the twin's factor {factor}")
    heads = {"n_heads": 2, "memory_heads": 2}
    narrow = {"dim": TWIN_WIDTH, "memory_dim": TWIN_WIDTH, "ffn_hidden": 2 * TWIN_WIDTH, "vocab_size": TWIN_VOCAB,
              **heads, **{f: v // factor for f, v in lengths.items()}, **({"n_layers": depth} if depth else {})}
    for kv, of in (("n_kv_heads", "n_heads"), ("memory_kv_heads", "memory_heads")):
        if getattr(cfg, kv, None) is not None:  # grouped where the flavor groups
            narrow[kv] = heads[of] // (2 if getattr(cfg, kv) < getattr(cfg, of) else 1)
    if getattr(cfg, "head_dim", None) is not None and family.name == "transformer":
        narrow["head_dim"] = TWIN_WIDTH // heads["n_heads"]
    if family.name == "titans":
        narrow["memory"] = dataclasses.replace(cfg.memory, chunk_size=TWIN_MEMORY_CHUNK, dim=None, n_heads=None,
                                               head_dim=None)
    twin = dataclasses.replace(cfg, **{k: v for k, v in narrow.items() if hasattr(cfg, k)})
    if family.name == "transformer":  # the project's plain Llama decoder at the flavor's shape, as plain_step builds it
        from models.backbones.decoder_lm import DecoderLM

        return DecoderLM(twin), twin, seq_len // factor, factor
    return family.plain_class(twin), twin, seq_len // factor, factor


def shallowest(cfg) -> int:
    """The fewest decoder layers a twin of `cfg` builds with (Mela's MemStack adds after layers 1..H-1)."""
    return max(1, cfg.h_cycles - 1) if getattr(cfg, "memstack", False) else 1


def count_compiled(name: str, flavor: str, *, seq_len: int = 4096, batch: int = 2,
                   whole_sequence: bool = False) -> tuple[LaunchCount, dict]:
    """The launches of one training step's compiled graphs at the flavor's depth, extrapolated from
    two launch twins one decoder layer apart (`count_twin` at `shallowest` depth d and d + 1: every
    launch kind and the calls affine in the depth, as every decoder layer runs the same graphs;
    Inductor's lowering of a twin's graphs takes minutes on a CPU). Returns
    (the LaunchCount, {"factor", "seq_len", "width", "depths", "layers"} of the twins)."""
    from torchtitan_ext import plain_step

    with torch.device("meta"):
        cfg = plain_step.build(name, flavor)[1]
    layers, low = cfg.n_layers, shallowest(cfg)
    if layers <= low + 1:
        count, twin = count_twin(name, flavor, layers, seq_len=seq_len, batch=batch, whole_sequence=whole_sequence)
        return count, {**twin, "depths": (layers,), "layers": layers}
    (a, twin), (b, _) = (count_twin(name, flavor, depth, seq_len=seq_len, batch=batch, whole_sequence=whole_sequence)
                         for depth in (low, low + 1))
    extra = layers - low
    launches = Counter({kind: a.launches[kind] + extra * (b.launches[kind] - a.launches[kind])
                        for kind in a.launches | b.launches})
    count = LaunchCount(launches, graphs=b.graphs, calls=a.calls + extra * (b.calls - a.calls))
    return count, {**twin, "depths": (low, low + 1), "layers": layers}


def count_twin(name: str, flavor: str, depth: int | None = None, *, seq_len: int = 4096, batch: int = 2,
               whole_sequence: bool = False) -> tuple[LaunchCount, dict]:
    """The launches of one training step's compiled graphs on the config's launch twin
    (`launch_twin`, `depth` decoder layers), compiled as the family's training compiles it
    (`Family.compile`) and trained on the CPU (module docstring): (its LaunchCount, {"factor",
    "seq_len", "width"} of the twin)."""
    from kernels import bounded_compile
    from models.memory import chunk_loop
    from models.memory.neural_memory import use_whole_sequence
    from torchtitan_ext import plain_step
    from torchtitan_ext.families import family_and_overrides
    from torchtitan_ext.step_cost.recorder import FusedAdamW

    family = family_and_overrides(name)[0]
    torch.manual_seed(0)
    model, cfg, length, factor = launch_twin(name, flavor, seq_len, depth)
    if whole_sequence and not use_whole_sequence(model):
        raise ValueError(f"whole_sequence: {name} has no neural memory")
    state = _Counting()
    backend = counting_backend(state)
    torch._dynamo.reset()
    family.compile(model, backend)
    model.train()
    data = plain_step.inputs(family.name, batch, length, cfg.vocab_size, "cpu")
    optimizer = FusedAdamW(model.parameters())
    chunk_step = bounded_compile(chunk_loop.chunk_step, backend=backend)  # Titans' compiled chunk step, counted too
    kernels = _memory_kernels_unrun() if whole_sequence else contextlib.nullcontext()
    with mock.patch.object(chunk_loop, "compiled_chunk_step", lambda: chunk_step), kernels as forward_kernel:
        for counting in (False, True):  # the first step compiles every graph
            state.counting = counting
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = plain_step.loss_of(model, data)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    if whole_sequence and not forward_kernel.calls:
        raise RuntimeError(f"{name}_{flavor}: the whole-sequence memory kernels never ran: the chunk loop was taken "
                           "(kernels/whole_sequence.py `refusal` names why)")
    return state.count, {"factor": factor, "seq_len": length, "width": TWIN_WIDTH}
