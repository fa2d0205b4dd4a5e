"""Titans neural memory: chunked path vs a plain token-by-token reference, streaming,
memorisation, gradients."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from kernels.reference import newton_schulz_reference
from models.layers.diagnostics import recording
from models.memory.chunk_write import associative_grads, chunk_gates, clip_surprise, mlp_forward, surprise_limit
from models.memory.chunk_loop import chunk_step, chunked_memory, MemoryState, UpdateRule
from models.memory.neural_memory import NeuralMemory, NeuralMemoryConfig, SURPRISE_BOUND



@pytest.fixture(autouse=True)
def recording_diagnostics():
    """The clip shares some tests read are recorded diagnostics (`models.layers.diagnostics`)."""
    with recording():
        yield


@pytest.fixture(autouse=True)
def float64_by_default():
    """Parity is checked in float64 (restored afterwards for the other test modules)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def make_memory(**kw) -> NeuralMemory:
    torch.manual_seed(0)
    cfg = dict(dim=12, n_heads=2, head_dim=4, depth=2, expansion=2, chunk_size=3, max_lr=0.5)
    if kw.get("newton_schulz_steps"):
        cfg["gates"] = "chunk"
    memory = NeuralMemory(NeuralMemoryConfig(**{**cfg, **kw}))
    with torch.no_grad():  # livelier gates than the defaults, so every term matters
        memory.to_gates.weight.normal_(std=0.5)
        memory.to_gates.bias.fill_(0.0)
        if memory.cfg.output_norm:
            memory.out_norm.weight.normal_(1.0, 0.3)
        if memory.cfg.output_gate:
            memory.to_out_gate.weight.normal_(std=0.5)
    return memory


def reference(memory: NeuralMemory, x: torch.Tensor) -> torch.Tensor:
    """The layer written plainly: one batch row, one head, one token at a time. The conv
    as a sum over the last K projections; per chunk, every token's gradient (autograd)
    taken at the weights before the chunk; then either the per-token scan
    S = eta_t S - theta_t u_t, M = (1 - alpha_t) M + S (gates="token"), or one step
    S = mean(eta) S - sum theta_t u_t, M = (1 - mean(alpha)) M + [NS](S) (gates="chunk").
    With `max_update_norm` b each chunk's additions to M and S by its gradients (the token scan
    run from a zero state; the chunk rule's sum) are scaled to Frobenius norm <= b times the
    sum of the weights of the surprises in it (the same scan with every surprise 1)."""
    cfg = memory.cfg
    inner = cfg.n_heads * cfg.head_dim
    projected = x @ memory.to_qkv.weight.T  # (B, T, 3 * inner)
    if cfg.conv_kernel:
        kernel = memory.conv.weight[:, 0]  # (3 * inner, K)
        conved = torch.zeros_like(projected)
        for t in range(x.shape[1]):
            for j in range(cfg.conv_kernel):
                source = t - (cfg.conv_kernel - 1) + j
                if source >= 0:
                    conved[:, t] += kernel[:, j] * projected[:, source]
        projected = conved

    def heads(t):
        return t.view(*t.shape[:-1], cfg.n_heads, cfg.head_dim)

    q, k, v = (heads(projected[..., i * inner : (i + 1) * inner]) for i in range(3))
    if cfg.qk_norm:
        q, k = F.normalize(F.silu(q), dim=-1), F.normalize(F.silu(k), dim=-1)
    if cfg.value_silu:
        v = F.silu(v)
    gates = torch.sigmoid(memory.to_gates(x).view(*x.shape[:-1], 3, cfg.n_heads) + torch.tensor([0.0, 0.0, -4.0])[:, None])
    theta, eta, alpha = cfg.max_lr * gates[..., 0, :], gates[..., 1, :], gates[..., 2, :]
    eta = eta if cfg.momentum else torch.zeros_like(eta)
    alpha = alpha if cfg.forget else torch.zeros_like(alpha)

    def net(weights, inp):
        for i, w in enumerate(weights):
            inp = inp @ w
            if i < len(weights) - 1:
                inp = F.silu(inp)
        return inp

    def clip(g, weight_sum):  # a chunk's sum of weighted surprises scaled to norm <= bound * its weights' sum
        limit = cfg.surprise_bound * float(weight_sum)
        return g * min(1.0, limit / torch.linalg.matrix_norm(g).item()) if cfg.surprise_bound else g

    out = torch.zeros(x.shape[0], x.shape[1], cfg.n_heads, cfg.head_dim)
    for b, h in itertools.product(range(x.shape[0]), range(cfg.n_heads)):
        weights = [w[h].clone() for w in memory.initial()]
        momentum = [torch.zeros_like(w) for w in weights]
        for start in range(0, x.shape[1], cfg.chunk_size):
            tokens = range(start, min(start + cfg.chunk_size, x.shape[1]))
            for t in tokens:
                out[b, t, h] = net(weights, q[b, t, h])  # read-after-write overwrites this below
            if len(tokens) < cfg.chunk_size:
                break  # a partial chunk is not written yet
            grads = {}
            for t in tokens:
                with torch.enable_grad():
                    leaves = [w.detach().requires_grad_() for w in weights]
                    loss = ((net(leaves, k[b, t, h]) - v[b, t, h]) ** 2).sum()
                    grads[t] = torch.autograd.grad(loss, leaves)
            if cfg.gates == "token":
                def scan(weights, momentum, grads):
                    for t in tokens:
                        momentum = [eta[b, t, h] * s - theta[b, t, h] * u for s, u in zip(momentum, grads[t])]
                        weights = [(1 - alpha[b, t, h]) * w + s for w, s in zip(weights, momentum)]
                    return weights, momentum

                if cfg.surprise_bound:  # the scan is linear: old state's share + the chunk's sums, each clipped
                    zeros = {t: [torch.zeros_like(w) for w in weights] for t in tokens}
                    kept = scan(weights, momentum, zeros)
                    added = scan(zeros[start], zeros[start], grads)
                    # each sum's total weight: the same scan of a surprise of 1 from a zero state
                    totals = [-t[0] for t in scan([torch.tensor(0.0)], [torch.tensor(0.0)],
                                                  {t: [torch.tensor(1.0)] for t in tokens})]
                    weights, momentum = ([a + clip(g, total) for a, g in zip(*pair)]
                                         for pair, total in zip(zip(kept, added), totals))
                else:
                    weights, momentum = scan(weights, momentum, grads)
            else:
                summed = [clip(sum(theta[b, t, h] * grads[t][i] for t in tokens), sum(theta[b, t, h] for t in tokens))
                          for i in range(len(weights))]
                eta_c, alpha_c = eta[b, list(tokens), h].mean(), alpha[b, list(tokens), h].mean()
                momentum = [eta_c * s - g for s, g in zip(momentum, summed)]
                step = [newton_schulz_reference(s, cfg.newton_schulz_steps) if cfg.newton_schulz_steps else s for s in momentum]
                weights = [(1 - alpha_c) * w + s for w, s in zip(weights, step)]
            if cfg.read_after_write:
                for t in tokens:
                    out[b, t, h] = net(weights, q[b, t, h])
    if cfg.output_norm:
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6) * memory.out_norm.weight
    if cfg.output_gate:
        out = out * torch.sigmoid(x @ memory.to_out_gate.weight.T + memory.to_out_gate.bias)[..., None]
    return memory.out(out.flatten(-2))


TOKEN_CASES = [dict(gates="token", depth=d, chunk_size=c, **extra)
               for d, c in itertools.product([1, 2], [1, 3, 8])
               for extra in [{}, dict(momentum=False), dict(forget=False)]]
CHUNK_CASES = [
    dict(gates="chunk", depth=d, momentum=m, forget=f, newton_schulz_steps=ns, chunk_size=c)
    for d, m, f, ns, c in itertools.product([1, 2], [True, False], [True, False], [0, 5], [1, 3, 8])
    if not (m is False and f is False and ns == 5)
]
LAYER_CASES = [dict(conv_kernel=0), dict(conv_kernel=2, value_silu=False), dict(output_norm=False, output_gate=False),
               dict(qk_norm=False)]
BOUND_AND_RECOMPUTE_CASES = [dict(max_update_norm=b, checkpoint_chunks=g, **rule)
                             for b, g in ((0.3, 0), (0.0, 2), (0.3, 2))
                             for rule in ({}, dict(gates="chunk", newton_schulz_steps=5))]
READ_AFTER_WRITE_CASES = [dict(read_after_write=True, chunk_size=c, **rule)
                          for c in (1, 3) for rule in ({}, dict(gates="chunk", newton_schulz_steps=5))]


@pytest.mark.parametrize("case", TOKEN_CASES + CHUNK_CASES + LAYER_CASES + BOUND_AND_RECOMPUTE_CASES
                         + READ_AFTER_WRITE_CASES,
                         ids=lambda c: "-".join(f"{k[:3]}{v if isinstance(v, str) else int(v)}" for k, v in c.items()))
def test_chunked_path_equals_token_by_token_reference(case):
    memory = make_memory(**case)
    x = torch.randn(2, 18 if memory.cfg.read_after_write else 17, 12)  # read-after-write takes whole chunks
    y = memory(x)[0]  # with grad: `checkpoint_chunks` recomputes only when autograd records
    with torch.no_grad():
        torch.testing.assert_close(y, reference(memory, x), rtol=0, atol=1e-10)
    if case.get("max_update_norm"):
        assert 0 < memory.last_stats["clipped_share"] < 1  # the bound acts on some sums, not all


@pytest.mark.parametrize("case", TOKEN_CASES + CHUNK_CASES + LAYER_CASES + READ_AFTER_WRITE_CASES,
                         ids=lambda c: "-".join(f"{k[:3]}{v if isinstance(v, str) else int(v)}" for k, v in c.items()))
def test_the_default_surprise_bound_changes_nothing_where_updates_are_small(case):
    """Issue 46: on every reference case (float64, lively gates) at max_lr 0.1, ten times the
    default, the default bound clips no sum, and outputs, final weights and gradients equal the
    unbounded memory's (within 1e-6; in fact bit for bit). At the reference cases' own max_lr 0.5
    the depth-2 memories diverge even in float64 (a chunk's weighted mean surprise norm reaches
    1e37-1e68): there the bound acts, and `test_chunked_path_equals_token_by_token_reference`
    checks it against the reference's bounded rule. With Newton-Schulz the default is no bound."""
    def fwd_bwd_18(memory):  # 18 tokens: whole chunks for the read-after-write cases
        y, state = memory(torch.randn(2, 18, 12, generator=torch.Generator().manual_seed(0)))
        y.square().sum().backward()
        return [y.detach(), *state.weights] + [p.grad for p in memory.parameters()]

    bounded = make_memory(max_lr=0.1, **case)
    assert bounded.cfg.max_update_norm is None
    assert bounded.cfg.surprise_bound == (0.0 if case.get("newton_schulz_steps") else SURPRISE_BOUND)
    want = fwd_bwd_18(make_memory(max_lr=0.1, max_update_norm=0.0, **case))
    got = fwd_bwd_18(bounded)
    assert bounded.last_stats.get("clipped_share", 0) == 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_token_and_chunk_gates_agree_at_chunk_one_and_differ_beyond():
    x = torch.randn(1, 24, 12)
    with torch.no_grad():
        token, chunk = (make_memory(chunk_size=1, gates=g)(x)[0] for g in ("token", "chunk"))
        torch.testing.assert_close(token, chunk, rtol=0, atol=1e-12)
        token, chunk = (make_memory(chunk_size=8, gates=g)(x)[0] for g in ("token", "chunk"))
    assert (token[:, 8:] - chunk[:, 8:]).abs().max() > 1e-3


def test_read_after_write_reads_its_own_chunk_and_refuses_partial_chunks():
    x = torch.randn(1, 6, 12)
    with torch.no_grad():
        before, after = (make_memory(read_after_write=r)(x)[0] for r in (False, True))
        assert (before[:, :3] - after[:, :3]).abs().max() > 1e-4  # chunk 0 already reads its own write
        with pytest.raises(ValueError, match="not a multiple of chunk_size 3"):
            make_memory(read_after_write=True)(x[:, :5])


def test_newton_schulz_and_step_scale_with_token_gates_are_refused():
    for fields in ({"newton_schulz_steps": 5}, {"step_scale": 0.1}):
        with pytest.raises(ValueError, match="gates='chunk'"):
            NeuralMemoryConfig(gates="token", **fields)


def test_chunk_size_one_is_online_gradient_descent_and_differs_from_larger_chunks():
    x = torch.randn(1, 12, 12)
    with torch.no_grad():
        online, chunked = make_memory(chunk_size=1)(x)[0], make_memory(chunk_size=4)(x)[0]
    assert (online[:, 4:] - chunked[:, 4:]).abs().max() > 1e-4  # the chunks really are sequential steps
    torch.testing.assert_close(online[:, :1], chunked[:, :1])  # both read the initial weights first


@pytest.mark.parametrize("gates", ["token", "chunk"])
@pytest.mark.parametrize("splits", [[17], [1, 16], [3, 3, 11], [5, 2, 7, 3], [16, 1]])
def test_streaming_in_segments_equals_one_pass(splits, gates):
    memory = make_memory(**(dict(gates="chunk", newton_schulz_steps=5) if gates == "chunk" else {}))
    x = torch.randn(2, 17, 12)
    with torch.no_grad():
        whole, whole_state = memory(x)
        state, parts = None, []
        for piece in torch.split(x, splits, dim=1):
            y, state = memory(piece, state)
            parts.append(y)
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=0, atol=1e-10)
    for a, b in zip(state.weights + (state.conv,), whole_state.weights + (whole_state.conv,)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def write_and_recall(n_pairs: int, passes: int, depth: int, lr: float = 0.5) -> tuple[float, float]:
    """Write n random (k, v) pairs `passes` times (chunked, plain GD) then read with k:
    returns (recall error of the written memory, of the unwritten memory)."""
    g = torch.Generator().manual_seed(0)
    d = 16
    keys = F.normalize(torch.randn(1, 1, n_pairs, d, generator=g), dim=-1)
    values = torch.randn(1, 1, n_pairs, d, generator=g)
    weights = tuple(torch.randn(1, 1, i, o, generator=g) * 0.1 for i, o in NeuralMemoryConfig(
        dim=d, n_heads=1, head_dim=d, depth=depth, expansion=2).layer_shapes())
    empty = torch.zeros(1, 1, 0)
    state = MemoryState(weights, tuple(torch.zeros_like(w) for w in weights),
                        (torch.zeros(1, 1, 0, d), torch.zeros(1, 1, 0, d), empty, empty, empty), torch.zeros(1, 0, 3 * d))
    untouched = state
    for _ in range(passes):
        ones = torch.ones(1, 1, keys.shape[2])
        no_momentum, no_forget = torch.full_like(ones, float("-inf")), 0 * ones
        _, state, _ = chunked_memory(state, keys, keys, values, lr * ones, no_momentum, no_forget, chunk=4)

    def error(s):
        recalled, _ = mlp_forward(s.weights, keys)
        return ((recalled - values) ** 2).mean().item()

    return error(state), error(untouched)


@pytest.mark.parametrize("depth", [1, 2])
def test_memory_memorises_random_associations(depth):
    lr = {1: 0.5, 2: 0.1}[depth]
    errors = [write_and_recall(8, passes, depth, lr)[0] for passes in (1, 3, 10, 30)]
    unwritten = write_and_recall(8, 1, depth)[1]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.05 * unwritten, (errors, unwritten)


def test_output_depends_on_what_was_written():
    memory = make_memory(chunk_size=4)
    query = torch.randn(1, 4, 12)
    with torch.no_grad():
        outputs = [memory(torch.cat([torch.randn(1, 8, 12), query], 1))[0][:, -4:] for _ in range(2)]
    assert (outputs[0] - outputs[1]).abs().max() > 1e-3


def test_the_traced_conv_as_shifted_products_equals_the_eager_conv1d(monkeypatch):
    """`NeuralMemory._convolve` under torch.compile (K shifted products) against its eager
    conv1d, after a history and over a slice of the conv's channels (float64)."""
    from models.memory import neural_memory

    memory = make_memory(chunk_size=4)
    with torch.no_grad():
        memory.conv.weight.normal_()
    projected, history = torch.randn(2, 7, 12), torch.randn(2, memory.cfg.conv_kernel - 1, 12)
    runs = []
    for compiling in (False, True):
        monkeypatch.setattr(neural_memory, "compiling", lambda: compiling)
        runs.append(memory._convolve(projected, history, slice(12, 24)))
    (eager, rest), (shifted, rest_shifted) = runs
    torch.testing.assert_close(shifted, eager, rtol=1e-12, atol=1e-12)
    assert torch.equal(rest, rest_shifted) and torch.equal(rest, projected[:, -3:])
    assert (eager - projected).abs().max() > 0.1


def test_the_traced_single_input_projection_equals_the_two_eager_ones(monkeypatch):
    """`NeuralMemory.forward` on the path torch.compile traces (q/k/v and gate projections as
    one matmul, `models.layers.tracing.project_together`) against its eager path: outputs, state and
    gradients (float64)."""
    from models.layers import tracing

    memory = make_memory(chunk_size=4)
    with torch.no_grad():
        memory.to_gates.bias.normal_()
    x = torch.randn(2, 10, 12, requires_grad=True)
    runs = []
    for traced in (False, True):
        monkeypatch.setattr(tracing, "compiling", lambda: traced)
        memory.zero_grad()
        x.grad = None
        y, state = memory(x)
        (y.sin().sum() + sum(w.square().sum() for w in state.weights)).backward()
        runs.append([y.detach(), *(w.detach() for w in state.weights), x.grad.clone(),
                     *(p.grad.clone() for p in memory.parameters())])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_explicit_gradient_equals_autograd():
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(2, 2, 4, 6, generator=g, requires_grad=True), torch.randn(2, 2, 6, 4, generator=g, requires_grad=True)]
    k, v, theta = torch.randn(2, 2, 5, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g), torch.rand(2, 2, 5, generator=g)
    other = torch.randn(2, 2, 5, generator=g)

    def loss(token_weight):
        return (token_weight[..., None] * (F.silu(k @ weights[0]) @ weights[1] - v) ** 2).sum()

    expected = [torch.autograd.grad(loss(w), weights) for w in (theta, other)]
    out, saved = mlp_forward(weights, k)
    got = associative_grads(weights, saved, out, v, 2 * torch.stack([theta, other], -1))  # 2: the squared error's
    for i in range(2):
        for layer in range(2):
            torch.testing.assert_close(got[layer][:, :, i], expected[i][layer])


@pytest.mark.parametrize("gates_rule,ns_steps", [("token", 0), ("chunk", 5)])
def test_gradcheck_of_the_chunked_update(gates_rule, ns_steps):
    g = torch.Generator().manual_seed(4)
    shapes = [(1, 1, 3, 4), (1, 1, 4, 3)]
    inputs = [torch.randn(s, generator=g, requires_grad=True) * 0.5 for s in shapes]
    inputs = [t.detach().requires_grad_() for t in inputs]
    q, k, v = (torch.randn(1, 1, 4, 3, generator=g, requires_grad=True) for _ in range(3))
    gates = [torch.rand(1, 1, 4, generator=g, requires_grad=True) for _ in range(3)]

    def run(w0, w1, q, k, v, theta, eta, alpha):
        state = MemoryState((w0, w1), (torch.zeros_like(w0), torch.zeros_like(w1)),
                            (k[:, :, :0], v[:, :, :0], theta[..., :0], eta[..., :0], alpha[..., :0]), q[0, 0, :0])
        y, s, _ = chunked_memory(state, q, k, v, theta, eta.log(), (1 - alpha).log(), chunk=2,
                              rule=UpdateRule(gates_rule, ns_steps))
        return y, *s.weights, *s.momentum

    assert torch.autograd.gradcheck(run, (*inputs, q, k, v, *gates))


def test_gradients_reach_every_outer_loop_parameter():
    memory = make_memory(newton_schulz_steps=5)
    y, _ = memory(torch.randn(2, 10, 12))
    y.square().sum().backward()
    for name, p in memory.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_newton_schulz_matches_muon_and_pushes_singular_values_to_one():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 6, 10, generator=g)
    expected = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(5):  # the published Muon iteration, written out
        a = expected @ expected.mT
        expected = 3.4445 * expected + (-4.7750 * a + 2.0315 * a @ a) @ expected
    torch.testing.assert_close(newton_schulz_reference(x, 5), expected)
    torch.testing.assert_close(newton_schulz_reference(x.mT, 5), expected.mT)  # tall input: transposed
    s = torch.linalg.svdvals(newton_schulz_reference(x, 5))
    assert s.min() > 0.6 and s.max() < 1.25
    before = torch.linalg.svdvals(x / torch.linalg.matrix_norm(x, keepdim=True))
    assert (s - 1).abs().max() < (before - 1).abs().max()


def fwd_bwd(memory: NeuralMemory) -> list[torch.Tensor]:
    """Output, final weights and every parameter's gradient of one forward + backward."""
    y, state = memory(torch.randn(2, 17, 12, generator=torch.Generator().manual_seed(0)))
    y.square().sum().backward()
    return [y.detach(), *state.weights] + [p.grad for p in memory.parameters()]


@pytest.mark.parametrize("gates", ["token", "chunk"])
def test_recomputing_groups_of_chunks_changes_nothing(gates):
    extra = dict(gates="chunk", newton_schulz_steps=5) if gates == "chunk" else {}
    kept, recomputed = (fwd_bwd(make_memory(checkpoint_chunks=n, **extra)) for n in (0, 2))
    for a, b in zip(kept, recomputed):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("gates", ["token", "chunk"])
def test_compiled_chunk_step_matches_eager(gates):
    results = []
    extra = dict(newton_schulz_steps=5) if gates == "chunk" else {}
    for compiled in (False, True):  # float64: fp32 rounding differences grow through 5 Newton-Schulz steps
        results.append(fwd_bwd(make_memory(compiled_chunk_step=compiled, gates=gates, **extra)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_surprise_bound_clips_each_weighted_gradient_sum_to_its_norm():
    """`surprise_limit` and `clip_surprise` against a loop over (batch row, head, weighting) with
    torch.linalg.norm: each sum G = sum_t w_t u_t / 2 scaled to norm <= bound * sum_t |w_t| / 2,
    an unclipped one unchanged bit for bit."""
    grads = [torch.randn(2, 3, 2, 4, 5) * 3, torch.randn(2, 3, 2, 5, 4) * 0.1]  # (B, H, K, in, out)
    token_weights = torch.randn(2, 3, 6, 2)  # (B, H, C, K), signed as the per-token rule's
    bound = 2.0
    clipped, scales = clip_surprise(grads, surprise_limit(token_weights, bound))
    expected_count = 0
    for i, (g, c) in enumerate(zip(grads, clipped)):
        for b, h, k in itertools.product(range(2), range(3), range(2)):
            norm = torch.linalg.matrix_norm(g[b, h, k]).item()
            limit = bound * token_weights[b, h, :, k].abs().sum().item() / 2
            torch.testing.assert_close(c[b, h, k], g[b, h, k] * min(1.0, limit / norm))
            if norm <= limit:
                assert torch.equal(c[b, h, k], g[b, h, k]) and scales[i, b, h, k] == 1
            expected_count += norm > limit
    assert (scales < 1).sum().item() == expected_count and 0 < expected_count < 24


@pytest.mark.parametrize("gates", ["token", "chunk"])
def test_a_surprise_bound_above_every_norm_changes_nothing(gates):
    extra = dict(gates="chunk", newton_schulz_steps=5) if gates == "chunk" else {}
    free, bounded = make_memory(max_update_norm=0.0, **extra), make_memory(max_update_norm=1e6, **extra)
    for a, b in zip(fwd_bwd(free), fwd_bwd(bounded)):
        assert torch.equal(a, b)
    assert bounded.last_stats["clipped_share"] == 0 and "clipped_share" not in free.last_stats


@pytest.mark.parametrize("gates", ["token", "chunk"])
def test_a_large_lr_memory_that_blows_up_stays_finite_under_the_surprise_bound(gates):
    """fp32, max_lr 10: without the bound the fast weights reach inf / NaN within 16 chunks;
    with it every output, weight and gradient stays finite, and the clipping is counted. (With
    Newton-Schulz the chunk rule's step is orthogonalised and does not blow up: plain momentum here.)"""
    extra = dict(gates="chunk") if gates == "chunk" else {}
    x = torch.randn(2, 64, 16, dtype=torch.float32, generator=torch.Generator().manual_seed(0)) * 3
    runs = {}
    for bound in (0.0, 1.0):
        torch.manual_seed(0)
        memory = NeuralMemory(NeuralMemoryConfig(dim=16, n_heads=2, head_dim=8, chunk_size=4, max_lr=10.0,
                                                 max_update_norm=bound, **extra)).float()
        y, state = memory(x)
        y.square().mean().backward()
        finite = [torch.isfinite(t).all().item() for t in (y, *state.weights, *(p.grad for p in memory.parameters()))]
        runs[bound] = (finite, memory.last_stats)
    assert not all(runs[0.0][0])
    assert all(runs[1.0][0]) and runs[1.0][1]["clipped_share"] > 0.5


@pytest.mark.parametrize("gates", ["token", "chunk"])
def test_the_surprise_bound_traces_into_one_graph_and_runs_on_meta(gates):
    """No `.item()` and no branch on a tensor value: the bounded chunk step traces with
    fullgraph=True (dynamo only, backend "eager") to the eager result and count, and a bounded
    memory runs forward + backward on the meta device with a meta share (no CPU constant)."""
    torch.manual_seed(0)
    rule = UpdateRule(gates=gates, backend="torch", max_update_norm=0.05)
    state = (torch.randn(2, 2, 2, 4, 8), torch.randn(2, 2, 2, 8, 4))  # fast weights and momentum stacked
    q, k, v = (F.normalize(torch.randn(2, 2, 3, 4), dim=-1) for _ in range(3))
    gates_c = [g[:, :, 0] for g in chunk_gates(torch.rand(2, 2, 1, 3), -torch.rand(2, 2, 1, 3),
                                                -0.1 * torch.rand(2, 2, 1, 3), gates)]
    eager = chunk_step(state, q, k, v, *gates_c, rule)
    traced = torch.compile(chunk_step, fullgraph=True, backend="eager")(state, q, k, v, *gates_c, rule)
    for a, b in zip(torch.utils._pytree.tree_leaves(eager), torch.utils._pytree.tree_leaves(traced)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert (eager[-1] < 1).any()  # some sums clipped
    with torch.device("meta"):
        memory = NeuralMemory(NeuralMemoryConfig(dim=12, n_heads=2, head_dim=4, chunk_size=3, gates=gates,
                                                 max_update_norm=0.05))
        y, _ = memory(torch.randn(2, 9, 12))
        y.sum().backward()
    assert y.device.type == memory.last_stats["clipped_share"].device.type == "meta"
    assert all(p.grad.device.type == "meta" for p in memory.parameters())


@pytest.mark.parametrize("gates", ["token", "chunk"])
def test_the_fast_weight_state_stays_float32_under_bf16_autocast(gates):
    """The state update's batched matmul (`token_scan_update`) runs with autocast off: under a
    CPU bf16 autocast the fast weights and momentum stay float32 after forward and backward."""
    torch.manual_seed(0)
    memory = NeuralMemory(NeuralMemoryConfig(dim=16, n_heads=2, head_dim=8, chunk_size=4, gates=gates)).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, state = memory(torch.randn(2, 12, 16, dtype=torch.float32))
        y.float().square().sum().backward()
    assert {t.dtype for t in (*state.weights, *state.momentum)} == {torch.float32}
    assert all(torch.isfinite(p.grad).all() for p in memory.parameters())
