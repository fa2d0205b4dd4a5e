"""Intervals for evaluation figures: over items (documents, samples) and over seeds then items.

A figure from several training seeds varies with the seed as well as with the items, so its
interval resamples both, in that order (a two-level bootstrap): draw S seeds with replacement
from the S seeds, then, inside each drawn seed, draw its items with replacement; the statistic
is taken over the pooled draw. With one seed this reduces to the plain bootstrap over items.

Statistics: "mean" (exact match, accuracy), "exp_mean" (perplexity from per-item NLL).
"""

from __future__ import annotations

import math

import torch

STATISTICS = {"mean": lambda means: means, "exp_mean": torch.exp}


def _percentiles(draws: torch.Tensor) -> tuple[float, float]:
    """2.5th and 97.5th percentiles of (R,) bootstrap draws."""
    ordered = draws.sort().values
    resamples = len(ordered)
    return ordered[int(0.025 * resamples)].item(), ordered[int(0.975 * resamples) - 1].item()


def bootstrap(per_item: torch.Tensor, resamples: int = 2000, seed: int = 0,
              statistic: str = "exp_mean") -> tuple[float, float]:
    """95% interval of statistic(mean) over items resampled with replacement; per_item (N,)."""
    per_item = torch.as_tensor(per_item, dtype=torch.float64)
    picks = torch.randint(0, len(per_item), (resamples, len(per_item)),
                          generator=torch.Generator().manual_seed(seed))
    return _percentiles(STATISTICS[statistic](per_item[picks].mean(1)))


def seed_item_bootstrap(per_seed: list, resamples: int = 2000, seed: int = 0,
                        statistic: str = "mean") -> tuple[float, float]:
    """95% interval of statistic(pooled mean), seeds resampled first, then items inside each.

    per_seed: S sequences of per-item values (one per training seed; lengths may differ).
    Each resample draws S seed indices with replacement, then for each drawn seed as many of
    its items with replacement as it has, and pools them (each item weighs the same)."""
    values = [torch.as_tensor(v, dtype=torch.float64).flatten() for v in per_seed]
    if not values or any(len(v) == 0 for v in values):
        raise ValueError("seed_item_bootstrap needs at least one seed, each with at least one item")
    generator = torch.Generator().manual_seed(seed)
    seed_picks = torch.randint(0, len(values), (resamples, len(values)), generator=generator)
    totals = torch.zeros(resamples, dtype=torch.float64)
    counts = torch.zeros(resamples, dtype=torch.float64)
    for index, items in enumerate(values):
        drawn = (seed_picks == index).sum(1)  # (R,) how often seed `index` was drawn
        for repeat in range(1, int(drawn.max().item()) + 1):
            rows = drawn >= repeat
            picks = torch.randint(0, len(items), (int(rows.sum().item()), len(items)), generator=generator)
            totals[rows] += items[picks].sum(1)
            counts[rows] += len(items)
    return _percentiles(STATISTICS[statistic](totals / counts))


def summarize_seeds(per_seed: list, statistic: str = "mean", resamples: int = 2000) -> dict:
    """Pooled figure with its seeds-then-items interval, beside each seed's figure and its
    items-only interval: {"pooled", "ci95", "per_seed": [{"value", "ci95", "items"}], "seeds"}."""
    apply = STATISTICS[statistic]
    values = [torch.as_tensor(v, dtype=torch.float64).flatten() for v in per_seed]
    pooled = torch.cat(values)
    return {"pooled": float(apply(pooled.mean())), "ci95": list(seed_item_bootstrap(values, resamples, statistic=statistic)),
            "seeds": len(values),
            "per_seed": [{"value": float(apply(v.mean())), "ci95": list(bootstrap(v, resamples, statistic=statistic)),
                          "items": len(v)} for v in values]}


def format_summary(summary: dict, scale: float = 1.0, digits: int = 1) -> str:
    """'pooled (low-high); seeds a, b, c' for a Markdown cell (scale 100 for percentages)."""
    low, high = (scale * x for x in summary["ci95"])
    seeds = ", ".join(f"{scale * s['value']:.{digits}f}" for s in summary["per_seed"])
    text = f"{scale * summary['pooled']:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"
    return text if summary["seeds"] == 1 else f"{text}; seeds {seeds}"



def fisher_greater(solved_a: int, runs_a: int, solved_b: int, runs_b: int) -> float:
    """One-sided Fisher exact test on a 2x2 table of counts (runs that succeeded in group a
    and in group b): the probability, with the margins fixed (hypergeometric), that group a
    holds at least `solved_a` of the successes. Small: a succeeds more often than b."""
    if not (0 <= solved_a <= runs_a and 0 <= solved_b <= runs_b):
        raise ValueError(f"counts out of range: {solved_a}/{runs_a} vs {solved_b}/{runs_b}")
    total, successes = runs_a + runs_b, solved_a + solved_b
    tables = math.comb(total, runs_a)
    tail = sum(math.comb(successes, k) * math.comb(total - successes, runs_a - k)
               for k in range(solved_a, min(successes, runs_a) + 1))
    return tail / tables


__all__ = ["bootstrap", "seed_item_bootstrap", "summarize_seeds", "format_summary", "fisher_greater"]
