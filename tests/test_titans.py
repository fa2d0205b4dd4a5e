"""Titans models: causality across segment and chunk boundaries, memory really used,
gradients to every outer-loop parameter, masks, sizes."""

from __future__ import annotations

import pytest
import torch

from conftest import load_script, streamed
from models.layers.diagnostics import recording
from models.lms.titans import mac_mask, prefix_window_mask, TitansConfig, TitansLM, VARIANTS
from models.memory.neural_memory import NeuralMemoryConfig

param_count = load_script("param_counts").param_count

VOCAB = 50


NS_CHUNK = dict(gates="chunk", newton_schulz_steps=5)  # Mela's rule, also a Titans option


def tiny(variant: str, window: int = 8, gate: str = "paper", mac_write: str = "attention", **kw) -> TitansLM:
    torch.manual_seed(0)
    memory = NeuralMemoryConfig(**dict(chunk_size=3, expansion=2) | kw)
    cfg = TitansConfig(variant=variant, vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, window=window, n_persistent=2,
                       gate=gate, mac_write=mac_write, memory=memory)
    model = TitansLM(cfg).double()
    with torch.no_grad():  # wake the gates up so every path carries signal
        for block in model.layers.values():
            block.memory.to_gates.weight.normal_(std=0.3)
            block.memory.cfg.max_lr = 0.5
    return model


@pytest.mark.parametrize("options", [{}, NS_CHUNK, dict(gate="convex")], ids=["paper", "ns_chunk", "convex"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_changing_token_t_never_changes_earlier_logits(variant, options):
    model = tiny(variant, **options)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 29), generator=g)  # 3.6 segments, ~10 chunks
    base = model(tokens)
    for t in [1, 2, 3, 7, 8, 9, 15, 16, 24, 28]:  # around chunk (3) and segment (8) edges
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % VOCAB
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
        assert (out[:, t:] - base[:, t:]).abs().max() > 1e-8


def test_mac_memory_writes_the_attention_output_or_with_mac_write_inputs_the_normed_segment(monkeypatch):
    """Eq. 2.50: MAC's memory takes the segment's attention output y; the "inputs" ablation its
    normed inputs. Each is what the memory's forward receives, segment by segment, in the plain
    reference (`_mac_per_segment`, which `_mac` equals: the next test); the ablation stays
    causal, and mac_write is refused for the other variants."""
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    for write in ("attention", "inputs"):
        model = tiny("mac", mac_write=write)
        for block in model.layers.values():
            monkeypatch.setattr(block, "_mac", block._mac_per_segment)
        block, seen = model.layers["0"], {"memory": [], "attention": [], "norm": []}
        block.memory.register_forward_hook(lambda m, args, out: seen["memory"].append(args[0]))
        block.attention.register_forward_hook(lambda m, args, out: seen["attention"].append(out))
        block.memory_norm.register_forward_hook(lambda m, args, out: seen["norm"].append(out))
        base = model(tokens)
        expected = seen["attention"] if write == "attention" else seen["norm"]
        assert len(seen["memory"]) == len(expected) == 3  # segments of 8 in 20 tokens
        for written, wanted in zip(seen["memory"], expected):
            torch.testing.assert_close(written, wanted, rtol=0, atol=0)
        other = seen["norm"] if write == "attention" else seen["attention"]
        assert (seen["memory"][0] - other[0]).abs().max() > 1e-3
        changed = tokens.clone()
        changed[:, 12] = (changed[:, 12] + 1) % VOCAB
        out = model(changed)
        torch.testing.assert_close(out[:, :12], base[:, :12], rtol=0, atol=1e-12)
        assert (out[:, 12:] - base[:, 12:]).abs().max() > 1e-8
    with pytest.raises(ValueError, match="MAC only"):
        TitansConfig(variant="mag", mac_write="inputs")


@pytest.mark.parametrize("write", ["attention", "inputs"])
@pytest.mark.parametrize("options", [{}, NS_CHUNK, dict(output_gate=False, output_norm=False, conv_kernel=0),
                                     dict(output_proj=False, expansion=2)],
                         ids=["paper", "ns_chunk", "plain_read", "no_output_proj"])
def test_hoisted_mac_equals_the_per_segment_reference(write, options):
    """`TitansBlock._mac` (state-independent work out of the segment loop, chained projections
    folded) against `_mac_per_segment` in float64: outputs, the new memory state and every
    gradient, over 3.6 segments and again continuing that state (a later call, RoPE offset)."""
    model = tiny("mac", mac_write=write, **options)
    block = model.layers["0"]
    with torch.no_grad():
        block.attention.persistent.normal_()
    x = torch.randn(2, 29, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    runs = []
    for mac in (block._mac, block._mac_per_segment):
        model.zero_grad()
        x.grad = None
        out, state = mac(x, None, 0)
        later, state = mac(x[:, :16].flip(1), state, 29)  # a second call from the first one's state
        (out.sin().sum() + later.cos().sum() + sum(w.square().sum() for w in state.weights)).backward()
        grads = {name: p.grad.clone() for name, p in block.named_parameters() if p.grad is not None}
        runs.append((out.detach(), later.detach(), [t.detach() for t in state.weights + state.momentum], grads, x.grad))
    (out, later, state, grads, x_grad), (out_ref, later_ref, state_ref, grads_ref, x_grad_ref) = runs
    assert grads.keys() == grads_ref.keys() and len(grads) >= 10
    pairs = [(out, out_ref), (later, later_ref), *zip(state, state_ref), (x_grad, x_grad_ref)]
    for a, b in pairs + [(grads[name], grads_ref[name]) for name in grads]:  # folded projections: rounding only
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10 * max(1.0, b.abs().max().item()))


def previous_token_gaps(model: TitansLM, positions: range) -> list[float]:
    """For each t: how much the logits at t move when token t - 1 changes."""
    tokens = torch.randint(0, VOCAB, (2, positions.stop + 1), generator=torch.Generator().manual_seed(3))
    base = model(tokens)
    gaps = []
    for t in positions:
        changed = tokens.clone()
        changed[:, t - 1] = (changed[:, t - 1] + 1) % VOCAB
        gaps.append((model(changed)[:, t] - base[:, t]).abs().max().item())
    return gaps


@pytest.mark.parametrize("variant", VARIANTS)
def test_token_t_minus_one_reaches_token_t_inside_memory_chunks(variant):
    """Memory chunk 8 (the paper's 64 : 512 chunk-to-window ratio), t across the chunk edge
    at 8: every t sees t - 1. For LMM only the q/k/v conv can carry it inside a chunk; without
    the conv the same check finds a blind position (the test can fail)."""
    positions = range(2, 14)
    assert min(previous_token_gaps(tiny(variant, window=64, chunk_size=8), positions)) > 1e-8
    if variant == "lmm":
        assert min(previous_token_gaps(tiny(variant, window=64, chunk_size=8, conv_kernel=0), positions)) == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_information_beyond_the_window_flows_only_through_the_memory(variant):
    """Token 0 can reach position 28 (window 8, 2 layers: attention reaches back 14) only
    through the memory: with writes (theta) and the data-dependent forget gate switched
    off it no longer does."""
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (1, 29), generator=g)
    changed = tokens.clone()
    changed[:, 0] = (changed[:, 0] + 1) % VOCAB
    written = tiny(variant)
    assert (written(changed)[:, -1] - written(tokens)[:, -1]).abs().max() > 1e-8
    unwritten = tiny(variant, forget=False)
    for block in unwritten.layers.values():
        block.memory.cfg.max_lr = 0.0
    gap = (unwritten(changed)[:, -1] - unwritten(tokens)[:, -1]).abs().max()
    if variant == "lmm":  # the memory is the only sequence mixer: no writes, no flow at all
        assert gap == 0
    else:
        assert gap < 1e-12


@pytest.mark.parametrize("options", [{}, NS_CHUNK, dict(gate="convex")], ids=["paper", "ns_chunk", "convex"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_reach_every_outer_loop_parameter(variant, options):
    model = tiny(variant, **options)
    logits = model(torch.randint(0, VOCAB, (2, 20)))
    logits.logsumexp(-1).sum().backward()
    names = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not names
    kinds = {n.split(".")[-1] for n, _ in model.named_parameters()}
    if variant != "lmm":
        assert "persistent" in kinds


def test_masks():
    q = torch.arange(4)[:, None]
    window = prefix_window_mask(n_prefix=2, window=2)(q, torch.arange(6)[None])
    assert window.tolist() == [[True, True, True, False, False, False], [True, True, True, True, False, False],
                               [True, True, False, True, True, False], [True, True, False, False, True, True]]
    mac = mac_mask(n_prefix=1, segment=3)(torch.arange(3)[:, None], torch.arange(7)[None])
    assert mac.tolist() == [[True, True, False, False, True, False, False], [True, True, True, False, True, True, False],
                            [True, True, True, True, True, True, True]]


@pytest.mark.parametrize("flavor,claimed", [("170m", 170e6), ("400m", 400e6), ("760m", 760e6)])
def test_paper_flavors_have_the_claimed_size(flavor, claimed):
    assert abs(param_count("titans", flavor, variant="mac") / claimed - 1) < 0.03


@pytest.mark.parametrize("variant", VARIANTS)
def test_memory_diagnostics_cover_every_layer(variant):
    from models.lms.titans import memory_diagnostics

    model = tiny(variant)
    model(torch.randint(0, VOCAB, (2, 20)))
    assert memory_diagnostics(model) == {}  # not recorded by default (models.layers.diagnostics)
    with recording():
        model(torch.randint(0, VOCAB, (2, 20)))
    metrics = memory_diagnostics(model)
    for layer in ("layer0", "layer1"):
        assert metrics[f"memory/{layer}/weight_norm"] > 0 and metrics[f"memory/{layer}/momentum_norm"] > 0
        assert 0 < metrics[f"memory/{layer}/memory_share"]
        if variant in ("mac", "mag"):
            g = [metrics[f"memory/{layer}/gate_{s}"] for s in ("min", "mean", "max")]
            assert 0 <= g[0] <= g[1] <= g[2] <= 1 and metrics[f"memory/{layer}/gate_std"] >= 0
        else:
            assert f"memory/{layer}/gate_mean" not in metrics


@pytest.mark.parametrize("variant", VARIANTS)
def test_segment_by_segment_equals_one_pass(variant, float64):
    torch.manual_seed(0)
    cfg = TitansConfig(variant=variant, vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, window=8, n_persistent=2,
                       memory=NeuralMemoryConfig(chunk_size=3, expansion=2))
    model = TitansLM(cfg).eval()
    tokens = torch.randint(0, VOCAB, (2, 45), generator=torch.Generator().manual_seed(1))
    splits = [8, 16, 8, 13] if variant == "mac" else [5, 1, 11, 20, 8]
    with torch.no_grad():
        whole = model(tokens)
    torch.testing.assert_close(streamed(model, tokens, splits), whole, rtol=1e-10, atol=1e-10)
    if variant == "mac":
        with pytest.raises(ValueError, match="multiple of window = 8 tokens"), torch.no_grad():
            model.stream(tokens[:, :3], model.stream(tokens[:, :5])[1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_token_identity_is_not_drowned_by_the_first_block_at_init(variant):
    """At a fresh init, the token embeddings must stay a visible part of the residual stream
    after the first block: a gated block (MAC, MAG) adds an output of RMS about 0.5 whatever its
    weights, and 0.02 embeddings under it stalled MQAR recall (TitansConfig.embedding_std).
    Ratio: RMS of the embeddings / RMS of what the first block adds to them."""
    torch.manual_seed(0)
    model = TitansLM(TitansConfig(variant=variant, vocab_size=256, dim=64, n_layers=2, n_heads=4, window=64))
    tokens = torch.randint(0, 256, (4, 64))
    seen = {}
    model.layers["0"].register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out))
    with torch.no_grad():
        model(tokens)
    ratio = (seen["x"].pow(2).mean().sqrt() / (seen["out"] - seen["x"]).pow(2).mean().sqrt()).item()
    assert model.cfg.token_embedding_std == (1.0 if variant in ("mac", "mag") else model.cfg.init_std)
    if variant in ("mac", "mag"):
        assert ratio > 1.0, ratio  # 0.02 embeddings: about 0.04
    explicit = TitansConfig(variant=variant, vocab_size=256, dim=64, n_layers=2, n_heads=4, window=64, embedding_std=0.5)
    assert abs(TitansLM(explicit).tok_embeddings.weight.std().item() - 0.5) < 0.01


def test_diagnostics_add_no_op_to_a_step_unless_recorded():
    """Off (the default), a training step computes no statistic (`models.layers.diagnostics`): recording
    adds ops, and the step's outputs and gradients are the same either way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    model, x = tiny("mag"), torch.randint(0, VOCAB, (2, 20))
    runs = []
    for on in (False, True):
        model.zero_grad()
        with recording(on), Count() as count:
            out = model(x)
            out.square().mean().backward()
        runs.append((count.ops, out.detach(), [p.grad.clone() for p in model.parameters()]))
    (quiet, out_off, grads_off), (recorded, out_on, grads_on) = runs
    assert recorded > quiet
    assert torch.equal(out_off, out_on) and all(torch.equal(a, b) for a, b in zip(grads_off, grads_on))
