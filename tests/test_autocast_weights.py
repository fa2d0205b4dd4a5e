"""Weights cast once per forward under autocast (models/layers/autocast_weights.py), and Mela's
HMM called through it: the same forward values, gradients within bf16 rounding, each Linear
weight cast once instead of once per use, the memories' initial fast weights left fp32."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from models.layers import tracing
from models.layers.autocast_weights import call_with_linear_weights_cast, linear_weights_cast
from models.layers.decoder import Attention
from models.lms import mela as mela_module
from models.lms.mela import Mela, MelaConfig, mela_memory


class CastsOf(TorchDispatchMode):
    """The shapes of the tensors cast from fp32 to bf16 (aten._to_copy), in order."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32 \
                and kwargs.get("dtype") == torch.bfloat16:
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **kwargs)

    def count(self, shape) -> int:
        return self.shapes.count(tuple(shape))


class ThreeUses(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))  # not a Linear's: never cast

    def forward(self, x):
        for _ in range(3):
            x = torch.tanh(self.linear(x)) * self.scale
        return x


def no_cache_autocast():
    """CPU bf16 autocast without its weight cache: each matmul casts its weight, as each call of
    a compiled graph does."""
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)


def test_a_weight_used_three_times_is_cast_once_with_the_same_output():
    torch.manual_seed(0)
    module, x = ThreeUses(), torch.randn(4, 8)
    results = {}
    for way, call in (("per_use", module), ("once", lambda x: call_with_linear_weights_cast(module, x))):
        module.zero_grad()
        with no_cache_autocast(), CastsOf() as casts:
            y = call(x)
        y.float().square().sum().backward()
        results[way] = y, casts, module.linear.weight.grad.clone(), module.scale.grad.clone()
    per_use, once = results["per_use"][1], results["once"][1]
    assert per_use.count((8, 8)) == 3 and per_use.count((8,)) == 3
    assert once.count((8, 8)) == 0 and once.count((8,)) == 0 and once.count((8 * 8 + 8,)) == 1
    assert torch.equal(results["once"][0], results["per_use"][0])
    for grad_once, grad_per_use in zip(results["once"][2:], results["per_use"][2:]):
        assert grad_once.dtype == torch.float32
        torch.testing.assert_close(grad_once, grad_per_use, rtol=2e-2, atol=1e-3)


def test_without_autocast_nothing_is_cast():
    module = ThreeUses()
    assert linear_weights_cast(module) == {}
    x = torch.randn(2, 8)
    assert torch.equal(call_with_linear_weights_cast(module, x), module(x))
    with no_cache_autocast():
        assert sorted(linear_weights_cast(module)) == ["linear.bias", "linear.weight"]


SMALL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=2, memory_heads=2, patch_size=2, chunk_size=4,
             memory=mela_memory(expansion=2, learned_init=True))


def test_mela_casts_its_hmm_weights_once_and_keeps_the_fast_weights_fp32(monkeypatch):
    """Mela's HMM through `call_with_linear_weights_cast` against the plain call: logits equal
    (the same bf16 roundings), gradients within bf16 rounding; the learned initial fast weights
    are not among the cast tensors, and the HMM's Linear weights are cast once a forward, in one
    flat cast (the plain call, without autocast's cache, casts each at every module step)."""
    torch.manual_seed(0)
    model = Mela(MelaConfig(**SMALL))
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    with no_cache_autocast():
        cast = linear_weights_cast(model.hmm)
    assert cast and all(name.endswith(("weight", "bias", tracing.PREPARED_STACK)) for name in cast)
    assert not any("initial" in name for name in cast)
    assert all(t.dtype == torch.bfloat16 for t in cast.values())
    fusion_weight = model.hmm.l_module.input_fusion.w1.weight
    flat = (sum(t.numel() for name, t in cast.items() if not name.endswith(tracing.PREPARED_STACK)),)
    results = {}
    for way in ("once", "plain"):
        if way == "plain":
            monkeypatch.setattr(mela_module, "call_with_linear_weights_cast", lambda module, *args: module(*args))
        model.zero_grad()
        with no_cache_autocast(), CastsOf() as casts:
            logits = model(tokens)
        logits.float().logsumexp(-1).mean().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results[way] = logits, casts, grads
    (once, once_casts, once_grads), (plain, plain_casts, plain_grads) = results["once"], results["plain"]
    config = model.cfg
    steps = 24 // config.chunk_tokens * config.h_cycles * config.l_cycles  # the L-module's steps
    assert plain_casts.count(fusion_weight.shape) >= steps and plain_casts.count(flat) == 0
    assert once_casts.count(fusion_weight.shape) == 0 and once_casts.count(flat) == 1
    assert torch.equal(once, plain)
    assert once_grads.keys() == plain_grads.keys()
    initial = [name for name in once_grads if "initial_weights" in name]
    assert initial, "the learned initial fast weights get no gradient"
    for name in once_grads:
        torch.testing.assert_close(once_grads[name], plain_grads[name], rtol=5e-2, atol=2e-3, msg=name)


class CatsOf(TorchDispatchMode):
    """The shapes of aten.cat's outputs, in order."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.cat.default:
            self.shapes.append(tuple(out.shape))
        return out


class AttendThrice(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention(16, 2, 2, 10000.0, gated=True)

    def forward(self, x):
        positions = torch.arange(x.shape[1])
        for _ in range(3):
            x = x + self.attention(x, positions)
        return x


def test_a_group_projected_together_takes_its_stack_from_the_flat_cast(monkeypatch):
    """Traced (`compiling()` answered True, as inside a compiled graph), attention's q / k / v /
    gate projection concatenates its four weights at every call; through
    `call_with_linear_weights_cast` it takes the stack laid out in the one flat cast (no weight
    concatenation) and gives the same output; the prepared stack is gone after the call."""
    monkeypatch.setattr(tracing, "compiling", lambda: True)
    torch.manual_seed(0)
    module, x = AttendThrice(), torch.randn(2, 5, 16)
    stack_shape = (4 * 16, 16)
    outputs = {}
    for way, call in (("per_call", module), ("once", lambda x: call_with_linear_weights_cast(module, x))):
        with no_cache_autocast(), CatsOf() as cats:
            outputs[way] = call(x)
        outputs[way + "_cats"] = cats.shapes.count(stack_shape)
    assert outputs["per_call_cats"] == 3 and outputs["once_cats"] == 0
    assert torch.equal(outputs["once"], outputs["per_call"])
    assert not hasattr(module.attention.wq, tracing.PREPARED_STACK)
    with no_cache_autocast():
        cast = linear_weights_cast(module)
    stack = cast["attention.wq." + tracing.PREPARED_STACK]
    assert stack.shape == stack_shape
    assert torch.equal(stack, torch.cat([module.attention.wq.weight, module.attention.wk.weight,
                                         module.attention.wv.weight, module.attention.wg.weight]).to(torch.bfloat16))
