"""Mela (models/lms/mela.py): decoder parity with torchtitan's llama3 block, causality, the
recursion's gradient path, MemStack, streaming, memory use, Table 1 parameter shares."""

from __future__ import annotations

import pytest
import torch

from conftest import load_script, streamed
from models.layers.diagnostics import recording
from models.layers.decoder import DecoderBlock
from models.lms.mela import Mela, MelaConfig, mela_memory

SMALL = dict(vocab_size=64, dim=32, n_layers=3, n_heads=2, memory_heads=2, patch_size=2, chunk_size=4,
             memory=mela_memory(expansion=2))  # chunks of 8 text tokens + 4 memory tokens
VARIANTS = {
    "default": {},
    "no_memstack": dict(memstack=False),
    "weighted_sum": dict(fusion="weighted_sum", memory_dim=16),
    "h_only_no_ns": dict(fusion="h_only", newton_schulz_steps=0),
    "no_attention_3_cycles": dict(memory_attention=False, h_cycles=3, l_cycles=1),
    "per_step_chain": dict(memory_chain="per_step"),
}


def small_model(seed: int = 0, **fields) -> Mela:
    torch.manual_seed(seed)
    return Mela(MelaConfig(**(SMALL | fields)))


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def test_decoder_block_equals_torchtitan_llama3_block():
    from torchtitan.models.common.attention import VarlenMetadata

    from torchtitan_ext.families.transformer import FAMILY, model_config

    torch.manual_seed(0)
    titan = model_config("debug", "cpu").build()
    titan.init_states()
    titan_block = titan.layers["0"]
    s = FAMILY.config("debug")
    ours = DecoderBlock(s.dim, s.n_heads, s.n_kv_heads, s.ffn_hidden, rope_theta=500000, norm_eps=1e-5)
    ours.load_state_dict({k.replace("qkv_linear.", ""): v for k, v in titan_block.state_dict().items()})
    x = torch.randn(2, 24, s.dim)
    positions = torch.arange(24)
    starts = torch.tensor([0, 24, 48], dtype=torch.int32)  # one document per row
    expected = titan_block(x, VarlenMetadata(starts, starts, 24, 24), positions.expand(2, -1))
    torch.testing.assert_close(ours(x, positions), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_changing_token_t_never_changes_logits_before_t(variant):
    model = small_model(**VARIANTS[variant]).eval()
    x = tokens(2, 40)  # 5 chunks
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        base = model(x)
        for t in [0, 7, 8, 11, 24, 39] + torch.randint(1, 40, (4,), generator=generator).tolist():
            changed = x.clone()
            changed[:, t] = (changed[:, t] + 1) % SMALL["vocab_size"]
            out = model(changed)
            assert torch.equal(out[:, :t], base[:, :t]), (variant, t)
            assert not torch.equal(out[:, t], base[:, t])


@pytest.mark.parametrize("neural_memory", [True, False])
def test_information_crosses_more_than_one_chunk_only_through_the_neural_memory(neural_memory):
    """A token of chunk 0 reaches chunk 1 through its memory tokens (HMM output of chunk 0);
    chunk 2 and later only if the HMM's neural memories were written and read."""
    model = small_model(neural_memory=neural_memory).eval()
    x = tokens(1, 40)
    changed = x.clone()
    changed[:, 3] += 1
    with torch.no_grad():
        gap = (model(x) - model(changed)).abs().amax(-1)[0]
    assert gap[8:16].max() > 0
    assert (gap[16:].max() > 1e-6) == neural_memory


def test_only_the_last_cycle_runs_with_gradients():
    model = small_model(h_cycles=3, l_cycles=2, memory_chain="per_step")  # one module call per step
    seen = {"l": [], "h": []}
    for name in seen:
        module = getattr(model.hmm, f"{name}_module")
        module.register_forward_hook(lambda m, args, out, name=name: seen[name].append(
            (torch.is_grad_enabled(), args[0].requires_grad, out[0].requires_grad)))
    model(tokens(1, 16)).sum().backward()
    # (grad mode, input needs grad, output needs grad) per call; 2 L-steps per cycle. The
    # first step reads x_p itself; the last cycle starts from detached l, h states.
    no_grad = [(False, False, False)]
    assert seen["l"] == [(False, True, False)] + no_grad * 3 + [(True, False, True), (True, True, True)]
    assert seen["h"] == [(False, True, False)] + no_grad + [(True, False, True)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_parameter_gets_a_gradient(variant):
    model = small_model(**VARIANTS[variant])
    model(tokens(2, 20)).logsumexp(-1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


def parameters_without_gradient(model: Mela, length: int) -> list[str]:
    model(tokens(2, length)).logsumexp(-1).mean().backward()
    return [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]


def test_memory_writes_train_at_the_papers_two_chunks_per_sequence():
    """4096 tokens with P * C = 2048 in the paper: exactly 2 decoder chunks (here 16 tokens,
    P * C = 8). Reading after the write, every parameter learns; reading before it, the
    memories' write path (k, v projections, gates) gets exactly zero gradient."""
    model = small_model()
    assert model.cfg.chunk_tokens * 2 == 16 and model.cfg.min_trainable_seq_len <= 16
    assert not parameters_without_gradient(model, 16)
    before = small_model(memory_read="before_write", memory_chain="per_step")
    assert before.cfg.min_trainable_seq_len > 16
    missing = parameters_without_gradient(before, 16)
    assert missing and all(".memory.to_qkv" in n or ".memory.to_gates" in n for n in missing), missing


def test_diagnostics_cover_every_memory_block_cycle_and_decoder_layer():
    from models.lms.mela import mela_diagnostics

    model = small_model(h_cycles=3)
    model(tokens(2, 24))
    assert mela_diagnostics(model) == {}  # not recorded by default (models.layers.diagnostics)
    with recording():
        model(tokens(2, 24))
    metrics = mela_diagnostics(model)
    for kind, blocks in (("l", model.cfg.l_layers), ("h", model.cfg.h_layers)):
        for i in range(blocks):
            stats = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith(f"memory/hmm/{kind}{i}/")}
            assert stats["weight_norm"] > 0 and stats["update_ratio"] > 0 and 0 < stats["theta_mean"] < 0.01
            assert 0 < stats["eta_mean"] < 1 and 0 < stats["alpha_mean"] < 1
    assert all(metrics[f"memory/hmm/cycle{c}/{s}_change"] > 0 for c in range(3) for s in "lh")
    assert all(metrics[f"memory/decoder{i}/memstack_ratio"] > 0 for i in range(2))  # after layers 0, 1 (H = 3)
    masses = [metrics[f"memory/decoder{i}/memory_attention_mass"] for i in range(model.cfg.n_layers)]
    assert all(0 < m < 1 for m in masses)


def test_memstack_adds_only_at_memory_token_positions(monkeypatch):
    h_cycles = 3
    model = small_model(h_cycles=h_cycles).eval()
    added, original = [], Mela.memstack_addition
    monkeypatch.setattr(Mela, "memstack_addition", lambda self, z: added.append(original(self, z)) or added[-1])
    layer_outputs = []
    model.layers["0"].register_forward_hook(lambda m, args, out: layer_outputs.append(out))
    with torch.no_grad():
        model(tokens(2, 24))
    c = SMALL["chunk_size"]
    assert len(added) == h_cycles - 1  # after decoder layers 1 .. H-1
    for addition in added:
        assert torch.equal(addition[:, c:], torch.zeros_like(addition[:, c:]))
        assert addition[:, :c].abs().amax() > 0
    # MemStack off: same weights, the final fusion only. Layer 1's text-position outputs
    # (after the addition) are unchanged; its memory-token outputs are not.
    off = small_model(h_cycles=h_cycles, memstack=False).eval()
    state = {k.replace(f"fusions.{h_cycles - 1}.", "fusions.0."): v for k, v in model.state_dict().items()
             if not any(f"fusions.{i}." in k for i in range(h_cycles - 1))}
    off.load_state_dict(state)
    off.layers["0"].register_forward_hook(lambda m, args, out: layer_outputs.append(out))
    monkeypatch.setattr(Mela, "memstack_addition", original)
    with torch.no_grad():
        off(tokens(2, 24))
    y1_on, y1_off = layer_outputs[0] + added[0], layer_outputs[1]
    assert torch.equal(y1_on[:, c:], y1_off[:, c:])
    assert not torch.equal(y1_on[:, :c], y1_off[:, :c])


@pytest.mark.parametrize("chain", ["per_step", "per_block"])
@pytest.mark.parametrize("segments", [[8, 8, 8, 8, 7], [16, 23], [24, 3], [8, 1]], ids=str)
def test_segment_by_segment_equals_one_pass(segments, chain, float64):
    model = small_model(memory_chain=chain).eval()
    x = tokens(2, sum(segments))
    with torch.no_grad():
        whole = model(x)
    torch.testing.assert_close(streamed(model, x, segments), whole, rtol=1e-10, atol=1e-10)


def test_a_segment_ending_mid_chunk_must_be_the_last():
    model = small_model().eval()
    with torch.no_grad():
        _, state = model.stream(tokens(1, 12))
        with pytest.raises(ValueError, match="multiple of patch_size \\* chunk_size = 8 tokens"):
            model.stream(tokens(1, 8), state)


@pytest.mark.parametrize("chain", ["per_step", "per_block"])
def test_carried_state_has_constant_size(chain):
    model = small_model(memory_chain=chain).eval()
    sizes = []
    with torch.no_grad():
        state = None
        for _ in range(6):
            _, state = model.stream(tokens(1, 16), state)
            sizes.append(sum(t.numel() for t in torch.utils._pytree.tree_leaves(state) if torch.is_tensor(t)))
    assert len(set(sizes[1:])) == 1 and sizes[1] > 0


TABLE_1 = {"400m": (27.45, 65.75), "800m": (28.78, 66.35), "1b2": (18.19, 76.97)}  # memory %, language %


@pytest.mark.parametrize("flavor", sorted(TABLE_1))
def test_paper_sizes_match_table_1_shares(flavor):
    from torchtitan_ext.families.mela import model_config

    cfg = model_config(flavor)
    assert (cfg.h_cycles, cfg.l_cycles, cfg.h_layers, cfg.patch_size, cfg.chunk_size, cfg.vocab_size) == (4, 4, 8, 32, 64, 32000)
    shares, (memory, language) = load_script("param_counts").mela_shares(flavor), TABLE_1[flavor]
    assert abs(shares["memory"] / memory - 1) < 0.02 and abs(shares["language"] / language - 1) < 0.02


@pytest.mark.parametrize("flavor", ["400m", "800m", "1b2"])
def test_transformer_peer_has_the_mela_flavors_parameter_count(flavor):
    param_count = load_script("param_counts").param_count

    assert abs(param_count("transformer", f"mela_{flavor}_peer") / param_count("mela", flavor) - 1) < 0.02


def test_config_rejects_bad_ablation_settings():
    with pytest.raises(ValueError, match="fusion 'sum' unknown"):
        MelaConfig(fusion="sum")
    with pytest.raises(ValueError, match="do not turn off both"):
        MelaConfig(memory_attention=False, neural_memory=False)
    with pytest.raises(ValueError, match="needs n_layers >= 3"):
        MelaConfig(h_cycles=4, n_layers=2)
    with pytest.raises(ValueError, match="memory_chain 'per_block' needs memory_read 'after_write'"):
        MelaConfig(memory_read="before_write")


def test_ablation_flags_change_the_model():
    base = small_model()
    assert base.hmm.l_module.blocks[0].attention.wg is not None
    assert small_model(attention_gating=False).hmm.l_module.blocks[0].attention.wg is None
    assert small_model(newton_schulz_steps=0).hmm.h_module.blocks[0].memory.cfg.newton_schulz_steps == 0
    assert base.hmm.h_module.blocks[0].memory.cfg.newton_schulz_steps == 5
    assert not hasattr(small_model(neural_memory=False).hmm.h_module.blocks[0], "memory")


def memory_calls(model: Mela, length: int) -> dict[int, list[tuple]]:
    """Per HMM neural memory (by id): (state passed in, state returned) of each call in one
    forward of a fresh stream, in call order."""
    calls: dict[int, list[tuple]] = {}
    for block in [*model.hmm.l_module.blocks, *model.hmm.h_module.blocks]:
        block.memory.register_forward_hook(
            lambda m, args, out: calls.setdefault(id(m), []).append((args[1], out[1])))
    with torch.no_grad():
        model(tokens(1, length))
    return calls


def test_per_block_chain_carries_one_memory_through_every_step_and_chunk():
    """per_block: each call of a block's memory starts from the state its previous call
    returned (L-steps, cycles, then the next chunk), the first from the initial weights. per_step: a fresh stream's H*L + H
    step chains each start from a fresh memory (the initial weights, zero momentum), once over the whole sequence."""
    model = small_model(memory_chain="per_block", h_cycles=2, l_cycles=2)
    n_chunks = 3
    calls = memory_calls(model, 8 * n_chunks)
    l_block, h_block = id(model.hmm.l_module.blocks[0].memory), id(model.hmm.h_module.blocks[0].memory)
    assert len(calls[l_block]) == n_chunks * 2 * 2 and len(calls[h_block]) == n_chunks * 2
    for memory_id, chain in calls.items():
        memory = next(m for m in model.modules() if id(m) == memory_id)
        for start, initial in zip(chain[0][0].weights, memory.initial()):
            assert torch.equal(start[0], initial)
        for (state_in, _), (_, previous_out) in zip(chain[1:], chain):
            for a, b in zip(state_in.weights + state_in.momentum, previous_out.weights + previous_out.momentum):
                assert torch.equal(a, b)
    model = small_model(h_cycles=2, l_cycles=2, memory_chain="per_step")
    per_step = memory_calls(model, 8 * n_chunks)
    assert len(per_step[id(model.hmm.l_module.blocks[0].memory)]) == 2 * 2
    assert len(per_step[id(model.hmm.h_module.blocks[0].memory)]) == 2
    for memory_id, chain in per_step.items():  # each step's chain starts from the initial weights, zero momentum
        memory = next(m for m in model.modules() if id(m) == memory_id)
        for state_in, _ in chain:
            assert all(torch.equal(w[0], initial) for w, initial in zip(state_in.weights, memory.initial()))
            assert not any(m.any() for m in state_in.momentum)


def test_per_block_initial_memory_and_earlier_writes_learn_through_the_no_grad_cycles():
    """H = 2: the first cycle runs without gradient, yet the loss of chunk 2 (reading chunk 1's
    HMM output) reaches the initial fast weights and chunk 0's memory inputs."""
    model = small_model(memory_chain="per_block", h_cycles=2)
    x = tokens(1, 24)
    embeddings = []
    model.tok_embeddings.register_forward_hook(lambda m, args, out: embeddings.append(out.retain_grad() or out))
    model(x)[:, 16:].logsumexp(-1).sum().backward()
    assert embeddings[0].grad[:, :8].abs().sum() > 0  # chunk 0's tokens, two chunks back
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "initial_weights" in n)


def test_carry_passes_the_value_of_now_and_the_gradient_to_before_eagerly_and_compiled():
    """`carry`, the no-grad cycles' straight-through: the value of `now` bit for bit and the
    incoming gradient to `before` unchanged, eagerly (a custom autograd.Function) and traced by
    torch.compile (its pointwise form, which AOTAutograd's cache stores)."""
    from models.lms.mela import carry

    torch.manual_seed(0)
    now = torch.randn(3, 5)
    for run in (carry, torch.compile(carry, backend="aot_eager", fullgraph=True)):
        before, grad = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5)
        out = run(before, now)
        out.backward(grad)
        assert torch.equal(out, now) and torch.equal(before.grad, grad)


def test_per_block_chain_changes_what_the_decoder_reads():
    """Same weights, the two chains: chunk 0's HMM output (read by chunk 1) already differs,
    since per_block's second L-step reads the first one's write."""
    per_step, per_block = small_model(memory_chain="per_step"), small_model()
    per_block.load_state_dict(per_step.state_dict())
    x = tokens(2, 24)
    with torch.no_grad():
        a, b = per_step(x), per_block(x)
    assert torch.equal(a[:, :8], b[:, :8])  # chunk 0 reads memory_init in both
    assert not torch.allclose(a[:, 8:16], b[:, 8:16])


def test_memory_path_off_reads_memory_init_in_every_chunk():
    """The control: no information crosses a chunk boundary, and each chunk's logits equal
    those of the same chunk run alone from a fresh stream."""
    model = small_model(memory_path=False).eval()
    x = tokens(2, 24)
    changed = x.clone()
    changed[:, 3] += 1
    with torch.no_grad():
        out = model(x)
        assert torch.equal(model(changed)[:, 8:], out[:, 8:])
        torch.testing.assert_close(out[:, 16:24], model(x[:, 16:24]))
    assert small_model().cfg.memory_path  # the default reads the memory


def test_section_5_3_ablations_are_named_configs_on_the_1b_token_budget():
    import train_configs.mela as configs
    from torchtitan_ext.training import cli

    assert {"h_cycles_1", "h_cycles_2", "l_cycles_1", "l_cycles_2", "h_layers_2", "l_layers_2", "l_layers_8",
            "no_newton_schulz", "no_neural_memory", "per_step_chain"} <= set(configs.ABLATIONS)
    written = {n.removeprefix("mela_400m_") for n in vars(configs) if n.startswith("mela_400m_")}
    assert written == set(configs.ABLATIONS)  # one written-out config function per row, no other
    for name, (fields, _) in configs.ABLATIONS.items():
        config = getattr(configs, f"mela_400m_{name}")()
        model = config.model_spec.model.model
        assert config.training.steps * config.training.global_batch_size * config.training.seq_len == pytest.approx(
            1e9, rel=0.001), name
        assert all(getattr(model, k) == v for k, v in fields.items()), name
    parsed = cli.parse(["--module", "train_configs.mela", "--config", "mela_400m_h_cycles_2"])
    assert parsed.model_spec.model.model.h_cycles == 2 and parsed.model_spec.model.model.l_cycles == 4


def test_the_default_memory_step_keeps_float32_near_float64_and_the_unit_step_does_not():
    """Why `memory_step_scale` is 0.1 (module docstring): over 16 chunks of a fresh
    mela_debug, float32 stays within 1e-4 of float64 at the default step; eq. 10's unit step
    amplifies rounding chunk after chunk (measured 1.0 in the last chunk). Should the unit
    step ever stop doing so, the default deserves another look."""
    from torchtitan_ext.families.mela import model_config

    x = torch.randint(0, 4096, (1, 1024), generator=torch.Generator().manual_seed(3))
    gaps = {}
    for step in (0.1, 1.0):
        torch.manual_seed(0)
        model = Mela(model_config("debug", memory_step_scale=step)).eval()
        with torch.no_grad():
            single = model(x)[0, -64:].double()
            double = model.double()(x)[0, -64:]
        gaps[step] = (single - double).abs().max().item()
    assert gaps[0.1] < 1e-4 and gaps[1.0] > 1e-2, gaps


def test_hmm_modules_compile_fullgraph_to_one_graph_per_grad_mode_and_match_eager():
    """Training with compile on compiles the HMM's L- and H-module with fullgraph=True
    (torchtitan_ext/families/mela.py `compile_hmm`; aot_eager here): over a training step of 4
    chunks (fresh, then carried states; grad-off and grad-on cycles) and an evaluation forward,
    each module compiles one graph per grad mode (`uniform_call`; 9 graphs for the two
    modules before it), none holding a node AOTAutograd's cache refuses (a launch would trace
    them again: the write's SiLU backward as a custom autograd.Function took 25 s of Mela
    debug's first compiled step), and the step's logits and gradients equal the eager model's."""
    from torch._dynamo.utils import counters

    from compile_checks import cache_checked
    from torchtitan_ext.families.mela import compile_hmm, hmm_modules

    model, x = small_model(), tokens(2, 32)
    runs = []
    for compiled in (False, True):
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            refusals = []
            compile_hmm(model, cache_checked("aot_eager", refusals))
        model.zero_grad()
        logits = model(x)
        logits.float().square().mean().backward()
        runs.append((logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    with torch.no_grad():
        model.eval()(x)
    assert counters["stats"]["unique_graphs"] == 4 and refusals == []  # (L, H) x (grad on, off)
    assert all(model.get_submodule(name)._compiled_call_impl is not None for name in hmm_modules(model))
    (eager, eager_grads), (compiled, compiled_grads) = runs
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    assert len(compiled_grads) == len(eager_grads)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_uniform_inputs_keep_a_stacked_states_weights_as_views_of_its_stacks(grad):
    """A compiled module's inputs are made uniform (`uniform_inputs`); a memory state holding its
    [M; S] stacks keeps weights and momenta as views of them (no copy: the same storage), each
    stack's requires_grad equal to the grad mode, and the next write takes the stacks as they
    are (`state_stacks` returns the state's own)."""
    from models.lms.mela import uniform_inputs
    from models.memory.chunk_loop import state_stacks

    model = small_model()
    block = model.hmm.l_module.blocks[0]
    state = block.memory.empty_state(2, dtype=torch.float32)
    x = torch.randn(2, 8, 32)
    with torch.set_grad_enabled(grad):
        same_x, uniform_state = uniform_inputs((x, state))
    assert torch.equal(same_x, x)
    assert uniform_state.stacked is not None and state_stacks(uniform_state) is uniform_state.stacked
    for stack, weight, momentum in zip(uniform_state.stacked, uniform_state.weights, uniform_state.momentum):
        assert stack.requires_grad == grad
        assert weight.data_ptr() == stack.data_ptr() and momentum.data_ptr() == stack[:, :, 1].data_ptr()
        assert weight.stride() == stack[:, :, 0].stride()
    for before, after in zip(state.weights + state.momentum, uniform_state.weights + uniform_state.momentum):
        assert torch.equal(before, after)
