"""Intervals of torchtitan_ext/eval/stats.py: the seeds-then-items bootstrap against a plain loop
written apart, and the properties a reader relies on (seed spread widens it, one seed = items)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from torchtitan_ext.eval.stats import bootstrap, fisher_greater, format_summary, seed_item_bootstrap, summarize_seeds


def loop_seed_item_interval(per_seed: list[list[float]], resamples: int, rng: random.Random) -> tuple[float, float]:
    """Reference: for each resample, draw seeds with replacement, then each drawn seed's items
    with replacement, and average the pooled draw; 2.5 / 97.5 percentiles by sorting."""
    means = []
    for _ in range(resamples):
        pooled = []
        for _ in per_seed:
            items = per_seed[rng.randrange(len(per_seed))]
            pooled += [items[rng.randrange(len(items))] for _ in items]
        means.append(sum(pooled) / len(pooled))
    means.sort()
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def test_seed_item_bootstrap_matches_a_plain_loop():
    rng = random.Random(0)
    per_seed = [[rng.random() < p for _ in range(40)] for p in (0.3, 0.5, 0.6)]
    per_seed = [[float(x) for x in seed] for seed in per_seed]
    ours = seed_item_bootstrap(per_seed, resamples=4000)
    reference = loop_seed_item_interval(per_seed, 4000, random.Random(1))
    assert ours == pytest.approx(reference, abs=0.03)


def test_seed_spread_widens_the_interval_beyond_items_only():
    low_seed, high_seed = [0.0] * 90 + [1.0] * 10, [0.0] * 10 + [1.0] * 90
    pooled = torch.tensor(low_seed + high_seed)
    items_low, items_high = bootstrap(pooled, statistic="mean")
    seeds_low, seeds_high = seed_item_bootstrap([low_seed, high_seed], statistic="mean")
    assert seeds_high - seeds_low > 3 * (items_high - items_low)
    assert seeds_low <= 0.5 <= seeds_high


def test_one_seed_reduces_to_the_item_bootstrap():
    values = torch.randn(200, generator=torch.Generator().manual_seed(3)).abs()
    assert seed_item_bootstrap([values], resamples=4000, statistic="exp_mean") == pytest.approx(
        bootstrap(values, resamples=4000), rel=0.02)


def test_bootstrap_of_nll_is_a_perplexity_interval_around_the_point():
    nll = torch.linspace(1.0, 3.0, 50)
    low, high = bootstrap(nll)
    assert low < math.exp(nll.mean().item()) < high


def test_summary_has_per_seed_figures_beside_the_pooled_one():
    summary = summarize_seeds([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0]], statistic="mean")
    assert summary["pooled"] == pytest.approx(0.5)
    assert [s["value"] for s in summary["per_seed"]] == pytest.approx([0.75, 0.0])
    assert [s["items"] for s in summary["per_seed"]] == [4, 2]
    text = format_summary(summary, scale=100)
    assert text.startswith("50.0 (") and text.endswith("seeds 75.0, 0.0")


def test_empty_seed_is_refused():
    with pytest.raises(ValueError, match="at least one item"):
        seed_item_bootstrap([[1.0], []])


@pytest.mark.parametrize("solved_a, runs_a, solved_b, runs_b", [(3, 5, 0, 5), (4, 6, 2, 4), (0, 3, 3, 4), (2, 2, 1, 6)])
def test_fisher_greater_counts_the_assignments(solved_a, runs_a, solved_b, runs_b):
    """The exact one-sided p by enumeration: every way of choosing which runs form group a,
    the share giving group a at least solved_a successes."""
    outcomes = [1] * (solved_a + solved_b) + [0] * (runs_a + runs_b - solved_a - solved_b)
    splits = list(itertools.combinations(range(len(outcomes)), runs_a))
    extreme = sum(sum(outcomes[i] for i in group) >= solved_a for group in splits)
    assert fisher_greater(solved_a, runs_a, solved_b, runs_b) == pytest.approx(extreme / len(splits), rel=1e-12)


def test_fisher_greater_refuses_impossible_counts():
    with pytest.raises(ValueError, match="out of range"):
        fisher_greater(4, 3, 0, 3)
