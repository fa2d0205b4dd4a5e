"""What model code does differently while torch.compile traces it: `compiling()` behind one
name (so that a cost model, `torchtitan_ext/step_cost/`, can answer it for the regions it
treats as compiled), and linear maps of one input run as one matmul there (`project_together`),
over a stack of their weights that a caller may prepare once for many calls (`prepared_stack`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


PREPARED_STACK = "prepared_stack"  # the attribute `prepared_stack` reads on a group's first linear


def compiling() -> bool:
    """True while torch.compile traces the calling code (`torch.compiler.is_compiling`)."""
    return torch.compiler.is_compiling()


def stacked(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights of `linears` (nn.Linear of one input width) stacked along their outputs
    (sum of out_features, in_features), and their biases likewise (zero where one has none;
    None when none has): one linear map whose output splits into theirs."""
    weight = torch.cat([linear.weight for linear in linears])
    if all(linear.bias is None for linear in linears):
        return weight, None
    return weight, torch.cat([linear.weight.new_zeros(linear.out_features) if linear.bias is None else linear.bias
                              for linear in linears])


def project_together(x: torch.Tensor, linears, biases: bool = True) -> list[torch.Tensor]:
    """x (..., in) through each of `linears`. Traced by torch.compile and all plain nn.Linear,
    one matmul over their weights stacked along the outputs (one kernel forward and two backward
    instead of one and two each; the same function, other rounding), each bias added to its own
    part after the split (a pointwise add that fuses into the part's consumer; a zero-padded
    stacked bias would be a kernel of its own at every call); eagerly, or when one is adapted (a
    LoRALinear, models/grafts/lora.py, adds its own path), one by one. `biases=False` leaves the
    biases out (for a consumer that adds them itself; plain nn.Linear only)."""
    plain = all(type(linear) is nn.Linear for linear in linears)
    if not biases and not plain:
        raise TypeError("project_together(biases=False) takes plain nn.Linear maps only")
    if not compiling() or not plain:
        return [linear(x) if biases else F.linear(x, linear.weight) for linear in linears]
    weight = prepared_stack(linears)
    parts = F.linear(x, weight).split([linear.out_features for linear in linears], -1)
    return [with_bias(part, linear) if biases else part for part, linear in zip(parts, linears)]


def prepared_stack(linears) -> torch.Tensor:
    """The weights of `linears` stacked (`stacked`), or the stack a caller prepared for this
    group: a tensor set as `linears[0].prepared_stack` for the duration of a call
    (`models.layers.autocast_weights.call_with_linear_weights_cast`: cast once a forward, so each
    call does not stack them again) when its rows are the group's."""
    prepared = getattr(linears[0], PREPARED_STACK, None)
    if prepared is not None and prepared.shape[0] == sum(linear.out_features for linear in linears):
        return prepared
    return stacked(linears)[0]  # the stacked bias unused: traced, it is dropped from the graph


def with_bias(part: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """A projection `part` (..., out) computed without its bias, plus `linear`'s bias (if any) in
    the part's dtype."""
    return part if linear.bias is None else (part + linear.bias).to(part.dtype)
