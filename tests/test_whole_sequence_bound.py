"""The surprise bound inside the whole-sequence kernels (kernels/whole_sequence.py `limit`;
models/memory/chunk_write.py `clip_surprise`): each chunk's G_m of each weight matrix scaled to
||G_m||_F <= limit_m, s = limit / max(||G||, limit) a constant in backward. Under
TRITON_INTERPRET=1 (conftest.py) against the float64 torch reference, with limits that clip
some chunks' sums and not others, over several hidden blocks and checkpoint strides > 1."""

from __future__ import annotations

import pytest
import torch

from test_whole_sequence import check_against_reference, inputs

from kernels.whole_sequence import whole_sequence_memory

SHAPE = (1, 2, 4, 8, 16, 64)  # batch, heads, chunks, chunk, head_dim, hidden (4 hidden blocks of 16)
UNBOUNDED = 1e30


def alternating_limits(ns_steps: int) -> torch.Tensor:
    """(B, H, N, K): no bound on even chunks, 0.1 on odd ones. At SHAPE's inputs the W_2 sums
    have norms about 0.09-0.16 and the W_1 sums 0.05-0.08: the odd chunks clip some sums and
    not others."""
    batch, heads, chunks = SHAPE[:3]
    limit = torch.full((batch, heads, chunks, 1 if ns_steps else 2), UNBOUNDED)
    limit[:, :, 1::2] = 0.1
    return limit


def kernel_scales(ns_steps: int, limit: torch.Tensor) -> torch.Tensor:
    """The forward kernel's clip scales (B*H, N, 2, 2) = [matrix][weighting] at SHAPE."""
    s1, s2, q, k, v, tw, gates = inputs(*SHAPE, ns_steps)
    flat_gates = gates if ns_steps else gates.flatten(-2)
    return torch.ops.memory_kernels.whole_sequence_fwd(q, k, v, tw, flat_gates, s1, s2, ns_steps, 0.7, False,
                                                       ns_steps > 0, 2, False, limit)[-1]


@pytest.mark.parametrize("ns_steps, checkpoint_every", [(0, 2), (2, 3)], ids=["token_rule", "newton_schulz"])
def test_bound_clips_some_chunks_and_matches_reference(ns_steps, checkpoint_every):
    """The kernels' outputs, final state and every gradient within 1e-5 of the float64 reference
    under the same limits (the backward recomputing the states between checkpoints, so the
    clip too); the limits clip some sums of the odd chunks (scale < 1) and none of the even."""
    limit = alternating_limits(ns_steps)
    scales = kernel_scales(ns_steps, limit)
    assert torch.equal(scales[:, 0::2], torch.ones_like(scales[:, 0::2]))
    odd = scales[:, 1::2]
    assert (odd < 1).any() and (odd == 1).any(), odd
    check_against_reference(SHAPE, ns_steps, False, ns_steps > 0, 1e-5, checkpoint_every=checkpoint_every,
                            limit=limit)


@pytest.mark.parametrize("ns_steps", [0, 2], ids=["token_rule", "newton_schulz"])
def test_bound_that_never_clips_equals_no_bound(ns_steps):
    """A limit no sum reaches gives scale 1 exactly: outputs, final state and gradients equal
    the unbounded kernels' bit for bit."""
    tensors = inputs(1, 2, 2, 8, 16, 64, ns_steps)
    options = dict(ns_steps=ns_steps, read_after_write=ns_steps > 0, checkpoint_every=2)
    limit = torch.full((1, 2, 2, 1 if ns_steps else 2), UNBOUNDED)
    results = []
    for bound in (None, limit):
        leaves = [t.detach().requires_grad_() for t in tensors]
        y, (n1, n2) = whole_sequence_memory((leaves[0], leaves[1]), *leaves[2:], limit=bound, **options)
        loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + n1.square().sum() + n2.sum()
        results.append([y, n1, n2, *torch.autograd.grad(loss, leaves)])
    for free, bounded in zip(*results):
        assert torch.equal(free, bounded)


def test_bound_shape_is_checked():
    """A limit of the wrong shape is refused with the shape expected."""
    s1, s2, q, k, v, tw, gates = inputs(1, 1, 2, 8, 16, 32, 0)
    with pytest.raises(ValueError, match="limit has shape"):
        whole_sequence_memory((s1, s2), q, k, v, tw, gates, limit=torch.ones(1, 1, 2, 1))
