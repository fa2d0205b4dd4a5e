"""Locas (models/memory/locas.py, paper 000): Locas-GLU's top-K cloning init, tau, clipping
and merge on the Llama / Qwen3 backbone; Locas-MLP's gradient-guided slots, NL-SVD cap and
merge on the MLP-FFN LM; the paper's parameter counts at Qwen3-0.6B / 1.7B shapes; the
whole-book protocol (torchtitan_ext/eval/whole_book.py): scoring before learning, causality, the
memory read and written, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import load_script
from models.backbones.decoder_lm import DecoderLM, DecoderLMConfig
from models.layers.ffn import SwiGLU
from models.lms.mlp_lm import MLPLM, MLPLMConfig
from models.memory.locas import (attach_locas, channel_importance, extra_parameters, init_glu_memories, LocasConfig,
                                 LocasGLU, memory_parameters, merge_locas, SidewaysFFN)
from torchtitan_ext.errors import UserError
from torchtitan_ext.eval.whole_book import chunk_nll, markdown, Protocol, read_document, Reader, run_whole_book

VOCAB = 96


def qwen3_model(seed: int = 0, architecture: str = "qwen3") -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(DecoderLMConfig(architecture=architecture, qk_norm=architecture == "qwen3", vocab_size=VOCAB, dim=32,
                                     n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_hidden=48,
                                     tie_embeddings=architecture == "qwen3")).eval()


def mlp_model(seed: int = 0) -> MLPLM:
    """0.02 embeddings (not the default N(0, 1)): at N(0, 1) a random model's tokens barely
    reach each other, so a chunk's gradient and each token's own come out alike (0.3% apart)."""
    torch.manual_seed(seed)
    return MLPLM(MLPLMConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, ffn_dim=64, embedding_std=0.02)).eval()


def document(length: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


PROTOCOL = Protocol(chunk=16, window=32, full_window=512, rank=8, lr=4e-2, templora_lr=1e-2, steps=1, value_scale=0.5)


# --- Locas-GLU: init, tau, clipping -------------------------------------------------------

def test_top_k_selection_equals_a_brute_force_ranking_and_bottom_k_its_reverse():
    torch.manual_seed(0)
    ffn, inputs = SwiGLU(16, 40), torch.randn(30, 16)
    brute = []
    for j in range(40):  # activation importance of channel j, token by token
        total = 0.0
        for a in inputs:
            g, u = (ffn.w1.weight[j] @ a).item(), (ffn.w3.weight[j] @ a).item()
            total += abs(g / (1 + torch.exp(torch.tensor(-g)).item()) * u)
        brute.append(total / len(inputs))
    order = sorted(range(40), key=lambda j: -brute[j])
    memory, generator = LocasGLU(16, 6), torch.Generator().manual_seed(0)
    assert set(memory.select_channels(ffn, inputs, "topk", generator).tolist()) == set(order[:6])
    assert set(memory.select_channels(ffn, inputs, "bottomk", generator).tolist()) == set(order[-6:])
    assert torch.allclose(channel_importance(ffn, inputs).double(), torch.tensor(brute, dtype=torch.float64), atol=1e-5)


def test_cloned_rows_are_unit_norm_copies_values_zero_and_tau_follows_the_formula():
    torch.manual_seed(0)
    ffn, inputs = SwiGLU(16, 40), torch.randn(30, 16)
    memory = LocasGLU(16, 6)
    memory.init_from_chunk(ffn, inputs, "topk", torch.Generator().manual_seed(0))
    channels = channel_importance(ffn, inputs).topk(6).indices
    for cloned, rows in ((memory.memory_gate, ffn.w1.weight), (memory.memory_key, ffn.w3.weight)):
        assert torch.allclose(cloned.norm(dim=1), torch.ones(6), atol=1e-6)
        assert torch.allclose(cloned, rows[channels] / rows[channels].norm(dim=1, keepdim=True), atol=1e-6)
    assert torch.count_nonzero(memory.memory_value) == 0
    down_rows = [ffn.w2.weight[:, j].norm().item() for j in range(40)]  # W_down[j, :] in the paper's (m, d) layout
    assert memory.tau.item() == pytest.approx(sum(down_rows) / 40 / 6, rel=1e-6)


@pytest.mark.parametrize("strategy", ["topk", "bottomk", "random_select", "gaussian", "norm_act"])
def test_a_fresh_memory_leaves_the_backbone_exactly_as_it_was(strategy):
    model, tokens = qwen3_model(), torch.tensor([document(24)])
    with torch.no_grad():
        before = model(tokens)
    sideways = attach_locas(model, LocasConfig(rank=8, init=strategy))
    for s in sideways:
        s.recording = True
    with torch.no_grad():
        model(tokens)
    init_glu_memories(sideways, LocasConfig(rank=8, init=strategy))
    assert all(torch.allclose(s.memory.memory_key.norm(dim=1), torch.ones(8), atol=1e-6) for s in sideways)
    with torch.no_grad():
        assert torch.equal(model(tokens), before)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        f"layers.{i}.feed_forward.memory.memory_{w}" for i in range(2) for w in ("gate", "key", "value")]


def test_clipping_holds_after_every_update_and_binds_at_a_large_lr():
    reader = Reader(qwen3_model(), "locas_glu", Protocol(chunk=16, window=32, rank=8, lr=1.0))
    ids = torch.tensor(document(16 * 5 + 1))
    for c in range(5):
        reader.read_chunk(ids[None, max(0, 16 * c + 17 - 32) : 16 * c + 17], 16)
        norms = torch.cat([w.norm(dim=1) for s in reader.sideways for w in
                           (s.memory.memory_gate, s.memory.memory_key, s.memory.memory_value)])
        assert norms.max() <= 1 + 1e-5
    assert (norms > 1 - 1e-4).float().mean() > 0.5  # the lr is large enough that the clip is what holds them


# --- merge ---------------------------------------------------------------------------------

@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_locas_glu_merges_into_a_plain_backbone_that_transformers_loads(tmp_path, architecture):
    from transformers import AutoModelForCausalLM

    from torchtitan_ext.families.backbone import hf_config, to_hf_keys
    from torchtitan_ext.hf_export import save_safetensors

    model, tokens = qwen3_model(architecture=architecture), torch.tensor([document(40)])
    attach_locas(model, LocasConfig(rank=8, layers="1"))  # one block: the other is padded with zero channels
    for p in memory_parameters([model.layers["1"].feed_forward]):
        torch.nn.init.normal_(p, std=0.3)
    model.layers["1"].feed_forward.memory.tau.fill_(0.7)
    with torch.no_grad():
        with_memory = model(tokens)
        merged = merge_locas(model)
        assert merged.cfg.ffn_hidden == 48 + 8 and not any(isinstance(m, SidewaysFFN) for m in merged.modules())
        assert torch.allclose(merged(tokens), with_memory, atol=1e-5)
    config = hf_config(merged.cfg)
    assert config.architectures == [{"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[architecture]]
    save_safetensors(to_hf_keys(merged.state_dict(), tied=architecture == "qwen3"), tmp_path, "2GB")
    config.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.allclose(plain(tokens).logits, with_memory, atol=1e-5)


def test_locas_mlp_merges_into_a_wider_mlp_lm():
    model, tokens = mlp_model(), torch.tensor([document(40)])
    sideways = attach_locas(model, LocasConfig(variant="mlp", rank=8))
    torch.manual_seed(3)
    for n, s in zip((5, 11), sideways):  # slot counts differ per block: the narrower is padded
        s.memory.set_slots(torch.randn(n, 32), torch.randn(n, 32) * 0.1)
    with torch.no_grad():
        with_memory = model(tokens)
        merged = merge_locas(model)
        assert merged.cfg.ffn_dim == 64 + 11
        assert torch.allclose(merged(tokens), with_memory, atol=1e-5)
        assert not torch.allclose(mlp_model()(tokens), with_memory, atol=1e-3)  # the slots did change the outputs


# --- parameter counts ----------------------------------------------------------------------

@pytest.mark.parametrize("flavor,rank,paper_millions", [("qwen3_0_6b", 64, 5.5), ("qwen3_1_7b", 16, 2.8),
                                                        ("qwen3_1_7b", 64, 11.0), ("qwen3_1_7b", 128, 22.0)])
def test_locas_glu_adds_the_papers_parameter_count_at_qwen3_shapes(flavor, rank, paper_millions):
    from torchtitan_ext.families.backbone import FAMILY

    with torch.device("meta"):
        model = DecoderLM(FAMILY.config(flavor))
    cfg = LocasConfig(rank=rank)
    added = sum(p.numel() for p in memory_parameters(attach_locas(model, cfg)))
    assert added == extra_parameters(cfg, 28, model.cfg.dim) == 3 * 28 * model.cfg.dim * rank
    assert round(added / 1e6, 1) == paper_millions  # Table 1 / Table 3


def test_locas_mlp_adds_two_l_d_r_once_grown():
    """Grown by the real path (Locas-MLP + BP's first chunk, 16 tokens for r = 8 slots)."""
    cfg = LocasConfig(variant="mlp", rank=8)
    reader = Reader(mlp_model(), "locas_mlp:bp", Protocol(chunk=16, window=32, rank=8))
    assert sum(p.numel() for p in memory_parameters(reader.sideways)) == 0  # nothing before the first chunk
    reader.read_chunk(torch.tensor([document(17)]), 16)
    assert [s.memory.slots for s in reader.sideways] == [8, 8]
    assert sum(p.numel() for p in memory_parameters(reader.sideways)) == extra_parameters(cfg, 2, 32) == 2 * 2 * 32 * 8


# --- Locas-MLP growth ----------------------------------------------------------------------

def test_gradient_guided_slots_raise_the_chunks_likelihood():
    """One chunk grown into a fresh Locas-MLP (keys the normalised FFN inputs, values eps times
    the globally normalised log-likelihood gradient) lowers that chunk's NLL: the memory is
    written and read."""
    model, ids = mlp_model(), torch.tensor([document(17)])
    reader = Reader(model, "locas_mlp:nlsvd", Protocol(chunk=16, window=32, rank=16, value_scale=0.05))
    before = reader.read_chunk(ids, 16)
    assert [s.memory.slots for s in reader.sideways] == [16, 16]  # one per token, below the 2r = 32 cap
    keys = torch.cat([s.memory.memory_key for s in reader.sideways])
    assert torch.allclose(keys.norm(dim=1), torch.ones(len(keys)), atol=1e-5)
    with torch.no_grad():
        after = chunk_nll(reader.model, ids, 16)
    assert after.mean() < before.mean() - 1e-3


def brute_force_slots(model, ids: list[int], scored: int, per_token: bool, eps: float):
    """Section 2.3's slots written out with a plain per-token loop on a model without Locas:
    per layer, keys A_t / ||A_t|| and values eps G_t / ||G_t||_global at the positions that
    predict the last `scored` tokens, G_t = d log p(x_t | x_<t) / dH_t (a fresh forward and
    backward per token) or d sum_t log p(x_t | x_<t) / dH_t (per_token False); and the raw
    global norms ||G_t||_global as Python floats."""
    first = len(ids) - scored - 1
    tokens = torch.tensor([ids])

    def forward():
        inputs, outputs = [], []
        def keep(module, args, out):
            inputs.append(args[0])
            outputs.append(out)

        hooks = [b.feed_forward.register_forward_hook(keep) for b in model.layers.values()]
        logp = model(tokens)[0].float().log_softmax(-1)
        for h in hooks:
            h.remove()
        return inputs, outputs, [logp[first + j, ids[first + j + 1]] for j in range(scored)]

    inputs, outputs, logps = forward()
    if not per_token:
        total = torch.autograd.grad(sum(logps), outputs)
    grads = [[] for _ in outputs]
    for j in range(scored):
        if per_token:
            _, outputs, logps = forward()
            per_layer = torch.autograd.grad(logps[j], outputs)
        else:
            per_layer = total
        for layer, g in enumerate(per_layer):
            grads[layer].append(g[0, first + j])
    norms = [sum(float(grads[layer][j].pow(2).sum()) for layer in range(len(grads))) ** 0.5 for j in range(scored)]
    slots = [(torch.stack([a[0, first + j] / a[0, first + j].norm() for j in range(scored)]),
              torch.stack([eps * g / norms[j] for j, g in enumerate(layer_grads)]))
             for a, layer_grads in zip(inputs, grads)]
    return slots, norms


@pytest.mark.parametrize("gradient", ["chunk", "token"])
def test_bp_slot_selection_takes_the_tokens_of_largest_raw_gradient_norm(gradient):
    """Locas-MLP + BP grows r slots from the first chunk's tokens of largest ||G_t||_global,
    ranked before the normalisation (after it every value has global norm eps)."""
    ids = document(17)
    reader = Reader(mlp_model(), "locas_mlp:bp", Protocol(chunk=16, window=32, rank=4, value_scale=0.5, gradient=gradient))
    reader.read_chunk(torch.tensor([ids]), 16)
    slots, norms = brute_force_slots(mlp_model(), ids, 16, gradient == "token", 0.5)
    picked = sorted(sorted(range(16), key=lambda j: -norms[j])[:4])
    assert max(norms) > 1.5 * min(norms)  # a ranking that rounding noise cannot make
    for s, (keys, values) in zip(reader.sideways, slots):
        torch.testing.assert_close(s.memory.memory_key.detach(), keys[picked], rtol=0, atol=1e-5)
        torch.testing.assert_close(s.memory.memory_value.detach(), values[picked], rtol=0, atol=1e-5)


def test_per_token_gradient_equals_a_per_token_autograd_loop():
    """gradient="token": every slot's value is eps G_t / ||G_t||_global with G_t the gradient
    of log p(x_t | x_<t) alone (A.1.6), checked against one forward and backward per token;
    the chunk's gradient gives other values."""
    ids, eps = document(21), 0.3
    values = {}
    for gradient in ("token", "chunk"):
        reader = Reader(mlp_model(), "locas_mlp:nlsvd", Protocol(chunk=20, window=32, rank=16, value_scale=eps,
                                                                 gradient=gradient))
        reader.read_chunk(torch.tensor([ids]), 20)
        values[gradient] = [s.memory.memory_value.detach() for s in reader.sideways]
        assert [s.memory.slots for s in reader.sideways] == [20, 20]  # one per token, under the 2r = 32 cap
    slots, _ = brute_force_slots(mlp_model(), ids, 20, True, eps)
    for got, (_, want) in zip(values["token"], slots):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.allclose(values["chunk"][0], values["token"][0], atol=1e-3)


def test_nl_svd_keeps_the_memory_at_most_two_r_slots_over_a_document():
    reader = Reader(mlp_model(), "locas_mlp:nlsvd", Protocol(chunk=16, window=32, rank=5, value_scale=0.05))
    ids, most = torch.tensor(document(16 * 6 + 1)), 0
    for c in range(6):
        reader.read_chunk(ids[None, max(0, 16 * c + 17 - 32) : 16 * c + 17], 16)
        most = max(most, *(s.memory.slots for s in reader.sideways))
    assert 0 < most <= 10


# --- the whole-book protocol ---------------------------------------------------------------

@pytest.mark.parametrize("model_fn,spec", [(qwen3_model, "locas_glu"), (qwen3_model, "templora"),
                                           (mlp_model, "locas_mlp:nlsvd"), (mlp_model, "locas_mlp:bp"),
                                           (qwen3_model, "truncated")])
def test_appending_future_text_never_changes_the_scores_of_earlier_chunks(model_fn, spec):
    model, doc = model_fn(), document(16 * 4 + 1)
    short, _ = read_document(model, spec, doc, PROTOCOL)
    longer, _ = read_document(model, spec, doc + document(40, seed=7), PROTOCOL)
    assert torch.equal(longer[: len(short)], short)


@pytest.mark.parametrize("model_fn,spec", [(qwen3_model, "locas_glu"), (qwen3_model, "templora"),
                                           (mlp_model, "locas_mlp:bp"), (mlp_model, "locas_mlp:nlsvd")])
def test_what_a_method_learns_is_read_later_and_the_first_chunk_is_scored_before_learning(model_fn, spec):
    model, doc = model_fn(), document(16 * 4 + 1)
    truncated, _ = read_document(model, "truncated", doc, PROTOCOL)
    learned, reader = read_document(model, spec, doc, PROTOCOL)
    assert torch.equal(learned[:16], truncated[:16])  # chunk 0: nothing learned yet
    assert not torch.allclose(learned[32:], truncated[32:], atol=1e-4)  # later chunks read what was written
    assert all(p.abs().sum() > 0 for p in reader.model.parameters() if p.requires_grad)
    assert all(not p.requires_grad for n, p in reader.model.named_parameters() if "memory" not in n and "lora" not in n)


def test_repeated_text_is_remembered_across_the_window():
    """A document that repeats a 48-token passage beyond the 32-token window: Locas-GLU
    lowers the NLL of the repeat relative to truncated attention (which cannot see it)."""
    passage = document(48, seed=3)
    doc = passage * 4 + passage[:1]
    model = qwen3_model()
    truncated, _ = read_document(model, "truncated", doc, PROTOCOL)
    locas, _ = read_document(model, "locas_glu", doc, Protocol(chunk=16, window=32, rank=8, lr=5e-2, steps=3))
    assert locas[96:].mean() < truncated[96:].mean() - 0.05


def test_seeds_pool_the_seeded_methods_and_report_each_seed():
    """--seeds: TempLoRA (a random A init) reads every document once per seed, truncated
    attention (no draw) once; the pooled perplexity is exp of the mean over seeds and
    documents, each seed's figure is its own documents', and the ratio pairs each seed with
    the reference's single run; checked against read_document called directly."""
    model, protocol = qwen3_model(), Protocol(chunk=16, window=32, rank=4, templora_lr=1e-2, seeds=(0, 1))
    docs = [document(49, seed=11), document(49, seed=12), document(49, seed=13)]
    results = run_whole_book(model, ["truncated", "templora"], docs, [], protocol)
    truncated, templora = (m["cumulative"][-1] for m in results["methods"])
    assert truncated["seeds"] == 1 and templora["seeds"] == 2 and templora["tokens"] == 48
    direct = {seed: [read_document(model, "templora", d, protocol, seed)[0].mean().item() for d in docs] for seed in (0, 1)}
    plain = [read_document(model, "truncated", d, protocol)[0].mean().item() for d in docs]
    assert direct[0] != direct[1]  # the seed matters
    assert templora["ppl"] == pytest.approx(math.exp(sum(direct[0] + direct[1]) / 6), rel=1e-9)
    per_seed = [s["value"] for s in templora["ppl_summary"]["per_seed"]]
    assert per_seed == pytest.approx([math.exp(sum(direct[s]) / 3) for s in (0, 1)], rel=1e-9)
    ratio = math.exp(sum(direct[s][i] - plain[i] for s in (0, 1) for i in range(3)) / 6)
    assert templora["ratio_to_reference"] == pytest.approx(ratio, rel=1e-9)
    assert templora["ppl_ci95"][0] <= templora["ppl"] <= templora["ppl_ci95"][1]
    assert "; seeds " in markdown(results) and "then documents" in markdown(results)


@pytest.mark.parametrize("model_fn,spec,variant", [(qwen3_model, "locas_glu:bottomk", "glu"),
                                                   (mlp_model, "locas_mlp:nlsvd", "mlp")])
def test_the_reader_attaches_locas_through_the_graft_table(monkeypatch, model_fn, spec, variant):
    """Locas is the "locas" row of models/grafts/graft.py's GRAFT_KINDS (attached at test
    time): the whole-book reader attaches it through that row, with the method's config."""
    import dataclasses

    from models.grafts import graft

    row, attached = graft.GRAFT_KINDS["locas"], []

    def recording(model, cfg):
        attached.append(cfg)
        return row.build(model, cfg)

    assert row.form == "test_time" and row.config is LocasConfig and row.build is attach_locas
    monkeypatch.setitem(graft.GRAFT_KINDS, "locas", dataclasses.replace(row, build=recording))
    reader = Reader(model_fn(), spec, Protocol(chunk=8, window=16, rank=8))
    assert [(c.variant, c.rank) for c in attached] == [(variant, 8)]
    assert all(isinstance(block.feed_forward, SidewaysFFN) for block in reader.model.layers.values())


def test_bad_methods_are_clear_errors():
    with pytest.raises(UserError, match="Locas-GLU needs a SwiGLU FFN"):
        Reader(mlp_model(), "locas_glu", PROTOCOL)
    with pytest.raises(UserError, match="Locas-MLP needs a two-layer MLP FFN"):
        Reader(qwen3_model(), "locas_mlp", PROTOCOL)
    with pytest.raises(UserError, match="rank 64 exceeds the FFN width 48"):
        Reader(qwen3_model(), "locas_glu", Protocol(chunk=16, window=32, rank=64))
    with pytest.raises(UserError, match="unknown"):
        Reader(qwen3_model(), "locas_glu:top3", PROTOCOL)


# --- the eval_long_ppl --ttt command ---------------------------------------------------------

@pytest.fixture(scope="module")
def backbone_folder(tmp_path_factory):
    from test_backbone import qwen3_debug_checkpoint

    folder = tmp_path_factory.mktemp("locas_backbone")
    qwen3_debug_checkpoint(folder)
    return folder


def eval_main(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        load_script("eval_long_ppl").main(argv)
    return stop.value.code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def book(tmp_path, words: int):
    text = " ".join(f"word{i % 37} of the book" for i in range(words))
    (tmp_path / "book.txt").write_text(text)
    return str(tmp_path / "book.txt")


def ttt_args(folder, dataset, out, *extra):
    return ["--checkpoint", str(folder), "--config", "train_configs.backbone:backbone_qwen3_debug", "--dataset", dataset,
            "--split", "all", "--window", "64", "--probe-docs", "0", "--out", str(out), *extra]


def test_ttt_mode_writes_cumulative_perplexity_and_a_merged_plain_export(backbone_folder, tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM

    out, merged = tmp_path / "out", tmp_path / "merged"
    load_script("eval_long_ppl").main(ttt_args(backbone_folder, book(tmp_path, 120), out, "--ttt",
                                               "truncated,locas_glu,templora", "--ttt-rank", "8", "--merge-out", str(merged)))
    results = json.loads((out / "results.json").read_text())
    assert [m["method"] for m in results["methods"]] == ["truncated", "locas_glu", "templora"]
    locas = results["methods"][1]
    assert locas["extra_parameters"] == 3 * 4 * 128 * 8 and locas["time_ratio"] > 0
    assert locas["cumulative"][-1]["tokens"] == results["document_tokens"][0] - 1
    assert (out / "cumulative_ppl.png").stat().st_size > 0 and "PPL@" in (out / "results.md").read_text()
    assert json.loads((merged / "config.json").read_text())["intermediate_size"] == 384 + 8
    AutoModelForCausalLM.from_pretrained(merged)  # a plain Qwen3ForCausalLM


@pytest.mark.parametrize("extra,message", [
    (["--ttt", "locas_glu", "--ttt-rank", "512"], "rank 512 exceeds the FFN width 384"),
    (["--ttt", "locas_mlp"], "Locas-MLP needs a two-layer MLP FFN"),
    (["--ttt", "locas_glu", "--chunk", "4096"], "must be positive and smaller than --window"),
    (["--ttt", "locas_glu", "--chunk", "48"], "fewer than one chunk"),
    (["--ttt", "templora", "--seeds", "0,0"], "give one or more distinct integers"),
    (["--ttt", "templora", "--seeds", "0,x"], "must be comma-separated integers"),
])
def test_ttt_bad_input_is_one_line_and_exit_2(backbone_folder, tmp_path, capsys, extra, message, tokenizer_dir):
    code, err = eval_main(ttt_args(backbone_folder, book(tmp_path, 6), tmp_path / "out", *extra), capsys)
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_fn,spec", [(qwen3_model, "locas_glu"), (qwen3_model, "templora"),
                                           (mlp_model, "locas_mlp:bp"), (mlp_model, "locas_mlp:nlsvd")])
def test_readers_run_on_the_meta_device_in_bf16_with_float32_memories(model_fn, spec):
    """As on a GPU in bf16: no CPU constant, no `.item()` in the init or the update path,
    the Locas fast weights kept in float32."""
    with torch.device("meta"):
        model = model_fn().to(torch.bfloat16)
    reader = Reader(model, spec, PROTOCOL)
    inputs = torch.zeros(1, 32, dtype=torch.long, device="meta")
    if spec.startswith("locas_mlp"):  # NL-SVD's eigh cannot run on meta: grow without compressing
        reader.locas.rank = 64
    for _ in range(2):
        nll = reader.read_chunk(inputs, 16)
    assert nll.device.type == "meta" and nll.shape == (16,)
    learned = [p for p in reader.model.parameters() if p.requires_grad]
    assert learned and all(p.device.type == "meta" for p in learned)
    if spec.startswith("locas"):
        assert all(p.dtype == torch.float32 for p in learned)
