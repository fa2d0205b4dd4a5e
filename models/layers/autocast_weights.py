"""Weights cast to autocast's dtype once per forward, for code that uses them many times.

Under autocast every matmul casts its fp32 weight to the lower-precision dtype. Eagerly autocast
caches the cast of a leaf parameter for the forward, but a compiled graph casts each weight it
uses again at every call (one kernel per weight per call): Mela's HMM calls its L- and H-module
graphs 40 times a step at 400m (2 chunks x (16 + 4) module steps), so its weight casts were 4
launches per memory block call, 768 a step. Casting once before the calls and handing the cast
tensors in (`call_with_linear_weights_cast`) leaves one flat cast a forward, and the weights a
module projects together (`tracing.project_together`) handed in already stacked.

Numerics (the choice, where the papers are silent): the forward's values are the same (the same
bf16 rounding of the same fp32 weights). The gradient of a weight used k times is the sum of k
bf16 gradients, summed in bf16 by autograd before the one cast back to fp32, where per-call casts
summed them in fp32; that is what eager autocast's weight cache does, and what FSDP2's mixed
precision (parameters all-gathered in bf16, torchtitan's multi-GPU default, where autocast is off
and these functions return the weights unchanged) does for every weight.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from models.layers.tracing import PREPARED_STACK


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast gives matmuls on `device`'s type while it is on there, else None."""
    kind = device.type
    if kind not in ("cpu", "cuda", "xpu", "mps") or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def linear_weights_cast(module: nn.Module) -> dict[str, torch.Tensor]:
    """{name: tensor cast to autocast's dtype} for the weight and bias of every nn.Linear in
    `module` that autocast would cast ({} while autocast is off). Other parameters (norms, the
    neural memories' initial fast weights, which stay fp32) are left out. The tensors are views
    of one flat cast per device and dtype (a concatenation and a cast: two launches forward and two
    backward for the module, where a cast each would take one per weight each way). The linear
    maps a submodule projects together (its `projection_groups()`: `tracing.project_together`)
    lie side by side in it, and their stack is handed in too, as `<first linear>.prepared_stack`
    (`tracing.prepared_stack`), so a traced call does not concatenate them again."""
    params, layout = _flat_layout(module)
    flats: dict[tuple, list[tuple[str, ...]]] = {}  # groups by (device, dtype, autocast dtype)
    for group in layout:
        param = params[group[0]]
        dtype = autocast_dtype(param.device)
        if dtype is not None and param.dtype != dtype:
            flats.setdefault((param.device, param.dtype, dtype), []).append(group)
    cast = {}
    for (_, _, dtype), groups in flats.items():
        flat = torch.cat([params[name].reshape(-1) for group in groups for name in group]).to(dtype)
        sizes = [[params[name].numel() for name in group] for group in groups]
        # one split of the flat cast (one backward concatenation), each group's span split again
        for group, group_sizes, span in zip(groups, sizes, flat.split([sum(s) for s in sizes])):
            if len(group) == 1:
                cast[group[0]] = span.view(params[group[0]].shape)
                continue
            cast |= {name: piece.view(params[name].shape) for name, piece in zip(group, span.split(group_sizes))}
            cast[group[0].removesuffix("weight") + PREPARED_STACK] = span.view(-1, params[group[0]].shape[1])
    return cast


def _flat_layout(module: nn.Module) -> tuple[dict[str, torch.Tensor], list[tuple[str, ...]]]:
    """The nn.Linear parameters of `module` by name, and their order in the flat cast: each group
    a submodule projects together (`projection_groups()`; a linear in one group at most) as a
    tuple of its weights' names, side by side, then every other parameter alone."""
    names = {id(m): name for name, m in module.named_modules()}
    layout, grouped = [], set()
    for owner in module.modules():
        for group in getattr(owner, "projection_groups", lambda: ())():
            if all(type(linear) is nn.Linear and id(linear) not in grouped for linear in group):
                grouped |= {id(linear) for linear in group}
                layout.append(tuple(f"{names[id(linear)]}.weight".lstrip(".") for linear in group))
    params = {}
    for prefix, linear in module.named_modules():
        if type(linear) is nn.Linear:
            params |= dict(linear.named_parameters(prefix, recurse=False))
    in_groups = {name for group in layout for name in group}
    return params, layout + [(name,) for name in params if name not in in_groups]


def call_with_linear_weights_cast(module: nn.Module, *args):
    """module(*args) with its nn.Linear weights cast to autocast's dtype once for the call
    (`linear_weights_cast`, through torch.func.functional_call; tied weights stay tied); a plain
    call while autocast is off."""
    cast = linear_weights_cast(module)
    if not cast:
        return module(*args)
    return functional_call(module, cast, args, strict=False, tie_weights=True)
