"""Recording one training step on the meta device: the dispatch and function modes that cost every op (`_Recorder`), the CUDA paths the meta device would not take, and `record_step`."""

from __future__ import annotations


import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
import warnings

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_ext.step_cost.hardware import Cost, Hardware, MULTI_TENSOR_ELEMENTS, MULTI_TENSOR_LIST, StepCost, Tag
from torchtitan_ext.step_cost.ops import (CUDA_COMPILED_FUNCTIONS, FULL_PRECISION, LOWER_PRECISION, MEMORY_DIR, MODEL_DIRS,
                                         OPT_DTYPE, READ_FUNCTIONS, attention_flops, matmul_flops, op_kind, tensor_bytes,
                                         tensors_of, whole_sequence_kernel_cost)


class _Recorder:
    """The state of one recording: phase, module stack, backward tag, autocast emulation,
    the open fused group of the compile model, the accumulated `StepCost`."""

    def __init__(self, cost: StepCost, bf16: bool, compiled: bool, compile_modules, compile_functions):
        self.cost = cost
        self.bf16 = bf16
        self.compiled = compiled
        self.compile_modules = compile_modules  # None: the whole model (when compiled)
        self.compile_functions = compile_functions
        self.region_functions = compile_functions - CUDA_COMPILED_FUNCTIONS  # the recipe's (Tag.region)
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
                if filename.startswith(MODEL_DIRS):
                    method = filename.startswith(MEMORY_DIR) and code.co_varnames[:1] == ("self",)
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
            base = dataclasses.replace(base, memory=memory)
        read = bool(names & READ_FUNCTIONS) if base.memory and own else base.read
        compiled = base.compiled or bool(names & self.compile_functions)
        region = base.region or bool(names & self.region_functions)
        attention = base.attention or self.attention_depth > 0
        function = function if own and function else base.function
        if self.attention_depth and self.attention_label:
            function = self.attention_label
        if self.phase == "backward" and not own and function == base.function:
            return base
        return Tag(base.module, base.memory, read, attention, compiled, function, region)

    def push(self, name: str, module: torch.nn.Module) -> None:
        parent = self.stack[-1] if self.stack else Tag()
        memory = parent.memory
        if not memory and type(module).__module__.startswith("models.memory."):
            memory = name
        region = parent.region or (self.compiled and (self.compile_modules is None or name in self.compile_modules))
        self.stack.append(Tag(name, memory, parent.read, parent.attention, parent.compiled or region, parent.function,
                              region))

    def pop(self) -> None:
        if self.stack:
            self.stack.pop()

    def enter_node(self, tag: Tag, grad_outputs):
        self.backward_tag = tag

    def tag_outputs(self, out) -> None:
        """Tag the autograd nodes of a torch function's outputs with the context they were made in."""
        tag = None
        for t in tensors_of(out):
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
        if tag.region and cls != "optimizer":
            self.cost.region_launches += cost.launches
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
        inputs = {id(t): t for t in tensors_of((args, kwargs))}
        outputs = tensors_of(out)
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
            # bf16 products under bf16 autocast, as the layer asks on CUDA (meta has no autocast)
            backward = func.overloadpacket.__name__.endswith("bwd")
            compute = max(flops / hw.program_flops(programs, self.bf16, backward), nbytes / hw.bytes_per_s)
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
        kind = op_kind(func)
        if kind == "sync" and any(t.device.type == "meta" for t in tensors_of(args)):
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
            if kwargs.get("dtype") is None and any(t.dtype in (torch.bfloat16, torch.float16) for t in tensors_of(args)):
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
    import models.layers.autocast_weights
    import models.layers.tracing

    def full_precision(device):
        return rec.no_autocast()

    def autocast_dtype(device):  # the emulated autocast's (meta has none)
        return torch.bfloat16 if rec.autocast_active() else None

    with contextlib.ExitStack() as stack:
        stack.enter_context(_rebound(kernels.token_step.full_precision, full_precision))
        stack.enter_context(_rebound(models.layers.attention.masked_attention,
                                     _eager_flex_attention(rec, rec.compiled)))
        stack.enter_context(_rebound(models.layers.attention.flex_block_mask, models.layers.attention._block_mask))
        stack.enter_context(_rebound(models.layers.tracing.compiling, lambda: rec.tag_now().compiled))
        stack.enter_context(_rebound(models.layers.autocast_weights.autocast_dtype, autocast_dtype))
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
