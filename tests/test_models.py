"""Model definitions: sizes, causality, document isolation, and the torchtitan wrappers."""

from __future__ import annotations

import pytest
import torch
from torchtitan.models.common.attention import create_varlen_metadata_for_document

from conftest import load_script
from models.lms.mlp_lm import MLPLM, MLPLMConfig
from torchtitan_ext.families import mlp_lm, transformer
from torchtitan_ext.families.plain_model import WrapperStateDictAdapter

param_count = load_script("param_counts").param_count

# Sizes the flavors claim: the Mela paper's three scales (Table 1) and Locas' "0.6B".
CLAIMED = {("transformer", "400m"): 400e6, ("transformer", "800m"): 800e6, ("transformer", "1b2"): 1.2e9,
           ("mlp_lm", "600m"): 0.6e9}


@pytest.mark.parametrize("family,flavor", sorted(CLAIMED))
def test_paper_flavors_have_the_claimed_size(family, flavor):
    assert abs(param_count(family, flavor) / CLAIMED[family, flavor] - 1) < 0.02


def tiny_mlp_lm(**kw) -> MLPLM:
    torch.manual_seed(0)
    return MLPLM(MLPLMConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, **kw)).double()


def tiny_transformer():
    torch.manual_seed(0)
    config = transformer.model_config("debug")
    model = config.build()
    model.init_weights(buffer_device=None)
    return model.double()


def mlp_lm_logits(model, tokens, positions):
    return model(tokens, positions)


def transformer_logits(model, tokens, positions):
    return model(tokens, positions=positions, attention_masks=create_varlen_metadata_for_document(positions))


MODELS = {"mlp_lm": (tiny_mlp_lm, mlp_lm_logits, 97), "transformer": (tiny_transformer, transformer_logits, 4096)}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_changing_token_t_never_changes_earlier_logits(name):
    build, logits_of, vocab = MODELS[name]
    model = build()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, 48), generator=g)
    positions = torch.arange(48).expand(2, 48)
    base = logits_of(model, tokens, positions)
    for t in torch.randint(1, 48, (4,), generator=g).tolist():
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % vocab
        out = logits_of(model, changed, positions)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=0)
        assert (out[:, t] - base[:, t]).abs().max() > 1e-6  # token t itself is read


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_documents_do_not_see_each_other(name):
    build, logits_of, vocab = MODELS[name]
    model = build()
    g = torch.Generator().manual_seed(2)
    doc_a, doc_b = torch.randint(0, vocab, (1, 20), generator=g), torch.randint(0, vocab, (1, 28), generator=g)
    packed = logits_of(model, torch.cat([doc_a, doc_b], 1), torch.cat([torch.arange(20), torch.arange(28)])[None])
    alone = logits_of(model, doc_b, torch.arange(28)[None])
    torch.testing.assert_close(packed[:, 20:], alone, rtol=1e-10, atol=1e-10)


def test_mlp_ffn_is_two_layer_with_elementwise_activation():
    model = tiny_mlp_lm(activation="relu")
    ffn = model.layers["0"].feed_forward
    x = torch.randn(3, 32, dtype=torch.float64)
    torch.testing.assert_close(ffn(x), torch.relu(x @ ffn.w1.weight.T) @ ffn.w2.weight.T)


def test_untied_token_embeddings_dominate_the_first_block_at_init_and_tied_ones_keep_logits_small():
    """Untied: N(0, 1) embeddings (torchtitan's llama3), so the token's identity dominates what the
    first block adds (under 0.02 embeddings the two were alike in size and MQAR recall stalled:
    docs/benchmarks.md "Initialisation and recall"). Tied: the table is the output layer too, so
    it keeps init_std and the logits at init stay O(1)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (4, 64))
    untied = MLPLM(MLPLMConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=256))
    seen = {}
    untied.layers["0"].register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out))
    with torch.no_grad():
        untied(tokens)
    ratio = (seen["x"].pow(2).mean().sqrt() / (seen["out"] - seen["x"]).pow(2).mean().sqrt()).item()
    assert abs(untied.tok_embeddings.weight.std().item() - 1.0) < 0.02
    assert ratio > 5.0, ratio  # 0.02 embeddings: about 1
    tied = MLPLM(MLPLMConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=256, tie_embeddings=True))
    with torch.no_grad():
        assert tied(tokens).std().item() < 0.5
    assert abs(tied.tok_embeddings.weight.std().item() - tied.cfg.init_std) < 0.002
    explicit = MLPLM(MLPLMConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=256, embedding_std=0.5))
    assert abs(explicit.tok_embeddings.weight.std().item() - 0.5) < 0.01


def test_tied_embeddings_are_retied_after_reinit_and_adapter_round_trips():
    spec = mlp_lm.model_spec("debug")
    spec.model.model.tie_embeddings = True
    model = spec.model.build()
    model.lm_head.weight = torch.nn.Parameter(torch.zeros_like(model.lm_head.weight))  # as after to_empty
    model.init_states()
    assert model.lm_head.weight is model.tok_embeddings.weight
    adapter = WrapperStateDictAdapter(spec.model, None)
    hf = adapter.to_hf(model.state_dict())
    assert "model.lm_head.weight" not in hf and "model.tok_embeddings.weight" in hf
    back = adapter.from_hf(hf)
    assert set(back) == set(MLPLM(spec.model.model).state_dict()) and back["lm_head.weight"] is hf["model.tok_embeddings.weight"]


def test_torchtitan_wrapper_has_exactly_the_plain_model_keys():
    spec = mlp_lm.model_spec("debug")
    assert set(spec.model.build().state_dict()) == set(MLPLM(spec.model.model).state_dict())


def test_flops_per_token_counts_matmuls_and_attention():
    spec = mlp_lm.model_spec("debug")
    model, cfg = spec.model.build(), spec.model.model
    n_params, flops = spec.model.get_nparams_and_flops(model, seq_len=256)
    assert n_params == sum(p.numel() for p in model.parameters())
    # For a plain decoder the count is the dense one: 6 per matmul weight (no embedding, no norms) + attention.
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert flops == 6 * matmul_params + 6 * cfg.n_layers * cfg.n_heads * 2 * cfg.head_dim * 256
