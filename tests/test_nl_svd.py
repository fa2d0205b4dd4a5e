"""NL-SVD memory compression (models/memory/nl_svd.py; Locas appendix A.1, Algorithm 1): exactness
on memories whose keys lie along a few orthonormal directions, exactness on the probe keys,
orthonormal keys, agreement with a plain per-slot SVD reference written here, slot counts,
zero-weight slots, dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models.memory.nl_svd import compress_if_full, mlp_memory, nl_svd


def nl_svd_reference(keys: torch.Tensor, values: torch.Tensor, rank: int, act=F.relu, eps: float = 1e-6):
    """Algorithm 1 written out slot by slot, apart from the code under test: s_i = ||k_i|| ||v_i||,
    row i of K_hat = s_i k_i / ||k_i|| (zero for a zero key or value), numpy's SVD of K_hat (n, d),
    the top `rank` right singular vectors whose squared singular value exceeds eps^2 times the
    largest, each flipped to point along sum_i K_hat_i, values v~_j = sum_i act(<p_j, k_i>) v_i."""
    k, v = keys.double().numpy(), values.double().numpy()
    rows = []
    for key, value in zip(k, v):
        a, b = np.linalg.norm(key), np.linalg.norm(value)
        rows.append(b * key if a > 0 and b > 0 else np.zeros_like(key))  # s_i k_i / ||k_i|| = ||v_i|| k_i
    weighted = np.stack(rows)
    _, sing, vh = np.linalg.svd(weighted, full_matrices=False)
    total = weighted.sum(0)
    probes, new_values = [], []
    for sigma, p in list(zip(sing, vh))[:rank]:
        if sigma ** 2 <= eps ** 2 * sing[0] ** 2:
            continue
        p = -p if p @ total < 0 else p
        probes.append(p)
        new_values.append(sum(act(torch.tensor(p @ key)).item() * value for key, value in zip(k, v)))
    width = k.shape[1]
    as_tensor = lambda xs, like: torch.tensor(np.array(xs).reshape(-1, width)).to(like.dtype)  # noqa: E731
    return as_tensor(probes, keys), as_tensor(new_values, values)


def random_memory(n: int, d: int, seed: int = 0, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=dtype), torch.randn(n, d, generator=g, dtype=dtype)


def test_exact_on_keys_along_orthonormal_directions():
    # Keys k_i = a_i u_c(i) (a_i > 0, u_c orthonormal) give, for any x,
    #   f(x) = sum_i ReLU(a_i <x, u_c(i)>) v_i = sum_c ReLU(<x, u_c>) w_c,  w_c = sum_{i in c} a_i v_i.
    # K_hat^T K_hat = sum_c (sum_{i in c} (a_i ||v_i||)^2) u_c u_c^T, so its eigenvectors are the u_c;
    # the sign convention picks +u_c (sum_{i in c} a_i ||v_i|| > 0), and the new values are
    # f(u_c) = w_c. The reduced memory sum_c ReLU(<x, u_c>) w_c is then f itself, for every x.
    d, q, n = 16, 4, 20
    g = torch.Generator().manual_seed(1)
    u = torch.linalg.qr(torch.randn(d, q, generator=g, dtype=torch.float64)).Q.T  # (q, d) orthonormal rows
    cluster = torch.arange(n) % q
    a = 2.0 ** cluster * (0.5 + torch.rand(n, generator=g, dtype=torch.float64))  # per-direction scale
    keys = a[:, None] * u[cluster]
    values = torch.randn(n, d, generator=g, dtype=torch.float64)
    eig = torch.zeros(q, dtype=torch.float64).index_add_(0, cluster, (a * values.norm(dim=-1)) ** 2)
    ordered = eig.sort().values
    assert (ordered.diff() / ordered[1:]).min() > 0.1  # well-separated eigenvalues: eigenvectors are the u_c

    new_keys, new_values = nl_svd(keys, values, rank=q)
    assert new_keys.shape == new_values.shape == (q, d)
    x = torch.randn(64, d, generator=g, dtype=torch.float64) * 3  # components outside span(u) too
    torch.testing.assert_close(mlp_memory(x, new_keys, new_values), mlp_memory(x, keys, values), rtol=0, atol=1e-10)

    expected = torch.zeros(q, d, dtype=torch.float64).index_add_(0, cluster, a[:, None] * values)
    match = (new_keys @ u.T).abs().argmax(dim=1)
    assert sorted(match.tolist()) == list(range(q))
    assert torch.equal(match, eig.argsort(descending=True))  # ordered by eigenvalue
    torch.testing.assert_close(new_keys, u[match], rtol=0, atol=1e-10)  # +u_c, not -u_c
    torch.testing.assert_close(new_values, expected[match], rtol=0, atol=1e-10)


def test_reduced_memory_is_exact_on_its_probe_keys():
    keys, values = random_memory(30, 10, seed=2)
    new_keys, new_values = nl_svd(keys, values, rank=5)
    assert new_keys.shape == (5, 10)
    torch.testing.assert_close(mlp_memory(new_keys, new_keys, new_values), mlp_memory(new_keys, keys, values),
                               rtol=0, atol=1e-10)


def test_keys_are_orthonormal_and_point_along_the_weighted_keys():
    keys, values = random_memory(40, 12, seed=3)
    new_keys, _ = nl_svd(keys, values, rank=7)
    torch.testing.assert_close(new_keys @ new_keys.T, torch.eye(7, dtype=torch.float64), rtol=0, atol=1e-12)
    weighted_sum = (values.norm(dim=-1, keepdim=True) * keys).sum(0)  # sum_i s_i k_i / ||k_i||
    assert (new_keys @ weighted_sum >= 0).all()


@pytest.mark.parametrize("act", [F.relu, torch.tanh])
def test_matches_the_svd_reference(act):
    keys, values = random_memory(40, 12, seed=4)
    fast = nl_svd(keys, values, rank=6, act=act)
    ref = nl_svd_reference(keys, values, rank=6, act=act)
    assert fast[0].shape == ref[0].shape == (6, 12)
    for got, want in zip(fast, ref):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-8)


def test_slot_counts():
    keys, values = random_memory(50, 8, seed=5)
    assert nl_svd(keys, values, rank=30)[0].shape == (8, 8)  # at most d

    keys, values = random_memory(31, 24, seed=6)
    same = compress_if_full(keys, values, capacity=32)
    assert same[0] is keys and same[1] is values
    keys, values = random_memory(32, 24, seed=6)
    new_keys, new_values = compress_if_full(keys, values, capacity=32)
    assert new_keys.shape == new_values.shape == (16, 24)  # capacity // 2 (d = 24 > 16 allows all 16)

    g = torch.Generator().manual_seed(7)
    keys = torch.randn(20, 3, generator=g, dtype=torch.float64) @ torch.randn(3, 10, generator=g, dtype=torch.float64)
    values = torch.randn(20, 10, generator=g, dtype=torch.float64)
    assert nl_svd(keys, values, rank=8)[0].shape == (3, 10)  # rank-deficient: 3 directions
    assert nl_svd_reference(keys, values, rank=8)[0].shape == (3, 10)


def test_zero_weight_slots_contribute_nothing():
    keys, values = random_memory(12, 6, seed=8)
    keys[2] = 0.0
    values[5] = 0.0
    new_keys, new_values = nl_svd(keys, values, rank=4)
    assert torch.isfinite(new_keys).all() and torch.isfinite(new_values).all()
    live = torch.tensor([i not in (2, 5) for i in range(12)])
    without = nl_svd(keys[live], values[live], rank=4)
    torch.testing.assert_close((new_keys, new_values), without, rtol=0, atol=1e-12)

    keys[:, :] = 0.0
    keys[0] = 1.0
    values[0] = 0.0  # every slot weightless
    for fn in (nl_svd, nl_svd_reference):
        new_keys, new_values = fn(keys, values, rank=4)
        assert new_keys.shape == new_values.shape == (0, 6)


def test_float32_in_float32_out_computed_in_float64():
    keys, values = random_memory(40, 12, seed=9, dtype=torch.float32)
    new_keys, new_values = nl_svd(keys, values, rank=6)
    assert new_keys.dtype == new_values.dtype == torch.float32
    keys64, values64 = nl_svd(keys.double(), values.double(), rank=6)
    torch.testing.assert_close(new_keys.double(), keys64, rtol=0, atol=1e-6)
    torch.testing.assert_close(new_values.double(), values64, rtol=1e-6, atol=1e-6)
    # Bit-identical to the float64 result rounded once: the whole computation ran in float64.
    assert torch.equal(new_keys, keys64.float()) and torch.equal(new_values, values64.float())
