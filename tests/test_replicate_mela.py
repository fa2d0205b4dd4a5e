"""scripts/replicate_mela_length.py's summary: perplexities and paired effects pooled over seeds,
with each seed's figure and an interval that resamples seeds, then documents."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import load_script

replicate = load_script("replicate_mela_length")


def test_summary_pools_seeds_reports_each_and_pairs_effects_by_seed_and_document():
    seeds, docs, length = 3, 6, replicate.CONTEXT * replicate.EVAL_MULTIPLES[-1] - 1
    generator = torch.Generator().manual_seed(0)
    full = 4.0 + 0.3 * torch.rand(seeds, docs, length, generator=generator, dtype=torch.float64)
    offsets = torch.tensor([0.0, 0.2, 0.4], dtype=torch.float64)[:, None, None]  # the chunk-local model is worse by seed
    losses = {"transformer, full": full, "transformer, chunk-local": full + offsets}
    results = replicate.summarize(losses)
    at_one_x = results["runs"]["transformer, full"]["results"][str(replicate.CONTEXT)]
    prefix = full[:, :, : replicate.CONTEXT - 1]
    assert math.isclose(at_one_x["ppl"], prefix.mean().exp().item(), rel_tol=1e-9)
    assert at_one_x["seeds"] == pytest.approx([math.exp(prefix[s].mean().item()) for s in range(seeds)], rel=1e-12)
    effect = results["effects"]["window effect: transformer chunk-local / full"][str(replicate.CONTEXT)]
    assert effect["seeds"] == pytest.approx([math.exp(o) for o in (0.0, 0.2, 0.4)], rel=1e-12)
    assert math.isclose(effect["ratio"], math.exp(0.2), rel_tol=1e-9)
    # documents agree within a seed, so the whole spread is the seeds': the interval spans them
    low, high = effect["ci95"]
    assert low < math.exp(0.1) and high > math.exp(0.3)
    table = replicate.markdown(results, steps=10)
    assert "seeds 1.000, 1.221, 1.492" in table


def test_an_interrupted_run_picks_up_the_trained_cells(tmp_path, monkeypatch):
    """Each (model, seed) is kept once trained; a rerun reads it back instead of training."""
    import argparse

    trained = []

    def fake_train(variant, stream, seed, steps):
        trained.append((variant.name, seed))
        return torch.nn.Identity(), lambda model, tokens: torch.zeros(*tokens.shape, 5), 1.0

    monkeypatch.setattr(replicate, "train", fake_train)
    monkeypatch.setattr(replicate, "precision_gap", lambda model, logits_of, doc: 0.5)
    docs = [torch.tensor([1, 2, 3, 4])]
    args = argparse.Namespace(out=tmp_path, steps=7)
    variant = replicate.VARIANTS[0]
    first = replicate.trained_cell(variant, None, docs, 1, args)
    again = replicate.trained_cell(variant, None, docs, 1, args)
    assert trained == [(variant.name, 1)]
    assert torch.equal(first["losses"], again["losses"]) and again["gap"] == 0.5
    assert first["losses"].shape == (1, 3) and torch.allclose(first["losses"], torch.full((1, 3), math.log(5)))
    replicate.trained_cell(variant, None, docs, 2, args)  # another seed is another cell
    assert trained == [(variant.name, 1), (variant.name, 2)]
