"""How an aten op is classified and counted: which source lines are model code or a memory's read, autocast's op lists, the ops that launch no kernel or sync, and the FLOPs of matmuls, attention and the whole-sequence kernels."""

from __future__ import annotations


import functools
import os

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import conv_flop_count, flop_registry

from kernels.whole_sequence import kernel_cost


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
MODEL_DIRS = tuple(os.path.join(_ROOT, d) + os.sep for d in ("models", "kernels"))
MEMORY_DIR = os.path.join(_ROOT, "models", "memory") + os.sep
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



def tensors_of(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of t's elements, a broadcast (stride 0) dimension counted once."""
    count = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            count *= size
    return count * t.element_size()


@functools.cache
def op_kind(func) -> str:
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
