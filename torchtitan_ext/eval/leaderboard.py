"""The leaderboard's report: every cell of DIR/cells/ pooled into one row per family and graft
(DIR/leaderboard.json), one Markdown table with the hypotheses' verdicts (DIR/leaderboard.md)
and two figures (DIR/ppl_vs_length.png, DIR/recall_vs_length.png). Rows, suites, hypotheses:
torchtitan_ext/eval/leaderboard_suites.py; cells: torchtitan_ext/eval/leaderboard_cells.py.

Intervals (torchtitan_ext/eval/stats.py): 95%, seeds resampled, then items (documents for
perplexity, prompts for recall) inside each seed; each seed's figure is kept beside the pooled
one. A hypothesis' comparison is paired: the same documents and prompts for every row and seed,
so the per-item difference (model - control: exact match; NLL, its exp a perplexity ratio)
of each seed is resampled the same way.

Verdict rule, for each comparison's interval: "better" is supported when the whole interval is
on the claimed side of no difference (recall: difference > 0; perplexity: ratio < 1; eval cost:
model / control eval tokens/s > 1), not supported when the whole interval is on the other side,
inconclusive otherwise; "match" is supported when the whole interval lies within +-5% (ratio
0.95-1.05, difference -0.05-0.05), not supported when it lies wholly outside, inconclusive
otherwise; a recall comparison where both rows answer nothing right (exact match 0 on every
item: the floor, where neither can show a difference) is inconclusive whatever its interval.
A hypothesis is supported when every comparison is, not supported when any is not,
else inconclusive at this scale; "not run" when a row it needs has no cell. The exploratory
comparisons (leaderboard_suites.EXPLORATORY, added after a run) are answered by the same rule
and reported apart from the hypotheses written before it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from torchtitan_ext.eval.leaderboard_suites import EXPLORATORY, HYPOTHESES, Hypothesis, MATCH_TOLERANCE, Suite
from torchtitan_ext.eval.stats import format_summary, seed_item_bootstrap, summarize_seeds


def load_cells(out: Path) -> dict[str, list[dict]]:
    """{row name: [cell dict per seed, by seed]} of every finished cell under out/cells/."""
    rows: dict[str, list[dict]] = {}
    for path in sorted((out / "cells").glob("*/seed*.json")):
        cell = json.loads(path.read_text())
        rows.setdefault(cell["row"], []).append(cell)
    return {name: sorted(cells, key=lambda c: c["seed"]) for name, cells in rows.items()}


def beyond(cell: dict) -> list[float]:
    """A cell's exact-match items at 2x-8x its row's window, every task pooled."""
    return [s for task in cell["recall"].values() for n, v in task.items() if int(n) > cell["window"] for s in v]


def inside(cell: dict) -> list[float]:
    """A cell's exact-match items at 1x its row's window, every task pooled."""
    return [s for task in cell["recall"].values() for n, v in task.items() if int(n) <= cell["window"] for s in v]


def summarize_row(cells: list[dict]) -> dict:
    """One row's figures: perplexity per length, recall per task and length and zero-shot
    accuracy per task (pooled, 95% interval, per seed; zero-shot None unless every seed has
    it), recall beyond the window, cost per seed and averaged."""
    ppl = {n: summarize_seeds([c["ppl"][n] for c in cells], "exp_mean") for n in cells[0]["ppl"]}
    recall = {task: {n: summarize_seeds([c["recall"][task][n] for c in cells]) for n in lengths}
              for task, lengths in cells[0]["recall"].items()}
    beyond_items = [beyond(c) for c in cells]
    costs = [{**c["cost"], **(c["train"] or {})} for c in cells]
    mean = {key: sum(c[key] for c in costs) / len(costs) for key in costs[0] if costs[0][key] is not None}
    zero_shot = {task: summarize_seeds([c["zero_shot"][task] for c in cells]) for task in cells[0]["zero_shot"]} \
        if all(c.get("zero_shot") for c in cells) else None
    return {"mode": cells[0]["mode"], "window": cells[0]["window"], "seeds": [c["seed"] for c in cells], "ppl_by_length": ppl,
            "zero_shot": zero_shot,
            "ppl_past_training_length": summarize_seeds([c["ppl_past"] for c in cells], "exp_mean"),
            "ppl_buckets": [c["buckets"] for c in cells], "recall_by_length": recall,
            "recall_beyond_window": summarize_seeds(beyond_items) if all(beyond_items) else None,
            "cost": {"mean": mean, "per_seed": costs}}


def items(cell: dict, metric: str) -> list[float]:
    """A cell's per-item values of a comparison metric: per-document NLL (ppl_past: past the
    training length; ppl_inside: the shortest length) or per-prompt exact match."""
    if metric == "ppl_past":
        return cell["ppl_past"]
    if metric == "ppl_inside":
        return cell["ppl"][min(cell["ppl"], key=int)]
    return beyond(cell) if metric == "recall_beyond" else inside(cell)


def paired(model: list[dict], control: list[dict], metric: str) -> tuple[float, float] | None:
    """95% interval of the model-vs-control figure over the seeds both ran: the paired
    exact-match difference (model - control), perplexity ratio (model / control) or eval
    tokens/s ratio (model / control, the range over seeds); None when they share no seed or
    the items do not pair."""
    seeds = {c["seed"]: c for c in control}
    pairs = [(m, seeds[m["seed"]]) for m in model if m["seed"] in seeds]
    if metric == "eval_cost" and pairs:
        ratios = [m["cost"]["eval_tokens_per_s"] / c["cost"]["eval_tokens_per_s"] for m, c in pairs]
        return min(ratios), max(ratios)
    values = [(items(m, metric), items(c, metric)) for m, c in pairs]
    if not values or any(not a or len(a) != len(b) for a, b in values):
        return None
    diffs = [torch.tensor(a) - torch.tensor(b) for a, b in values]
    return seed_item_bootstrap(diffs, statistic="exp_mean" if metric.startswith("ppl") else "mean")


def verdict(interval: tuple[float, float] | None, metric: str, sense: str) -> str:
    """supported / not supported / inconclusive of one comparison (module docstring's rule)."""
    if interval is None:
        return "not run"
    low, high = interval
    ratio = metric.startswith("ppl") or metric == "eval_cost"
    if sense == "match":
        tolerance = MATCH_TOLERANCE.get(metric, 0.05)
        centre = 1.0 if ratio else 0.0
        if centre - tolerance <= low and high <= centre + tolerance:
            return "supported"
        return "not supported" if high < centre - tolerance or low > centre + tolerance else "inconclusive"
    if ratio:
        favour = (high < 1.0, low > 1.0) if metric.startswith("ppl") else (low > 1.0, high < 1.0)
    else:
        favour = (low > 0.0, high < 0.0)
    return "supported" if favour[0] else "not supported" if favour[1] else "inconclusive"


def combine(verdicts: list[str]) -> str:
    if "not run" in verdicts:
        return "not run"
    if "not supported" in verdicts:
        return "not supported"
    return "supported" if all(v == "supported" for v in verdicts) else "inconclusive at this scale"


def answer_hypotheses(cells: dict[str, list[dict]], hypotheses: tuple[Hypothesis, ...] = HYPOTHESES) -> list[dict]:
    """Each hypothesis with its comparisons' intervals and verdicts, and its own verdict."""
    out = []
    for hypothesis in hypotheses:
        comparisons = []
        for model, control, metric, sense in hypothesis.comparisons:
            ran = model in cells and control in cells
            interval = paired(cells[model], cells[control], metric) if ran else None
            floor = ran and metric.startswith("recall") and not any(
                any(items(c, metric)) for c in cells[model] + cells[control])
            comparisons.append({"model": model, "control": control, "metric": metric, "sense": sense,
                                "ci95": interval,
                                "verdict": "inconclusive" if floor else verdict(interval, metric, sense)})
        out.append({"claim": hypothesis.claim, "comparisons": comparisons,
                    "verdict": combine([c["verdict"] for c in comparisons])})
    return out


def report(out: Path, chosen: Suite) -> dict:
    """leaderboard.json, leaderboard.md and the PNGs of every finished cell under `out`."""
    cells = load_cells(out)
    results = {"suite": chosen.name, "seq_len": chosen.seq_len, "window": chosen.window,
               "graft_window": chosen.graft_window,
               "training_tokens": chosen.training_tokens(), "seeds": list(chosen.seeds),
               "rows": {name: summarize_row(c) for name, c in cells.items()},
               "hypotheses": answer_hypotheses(cells), "exploratory": answer_hypotheses(cells, EXPLORATORY),
               "backbone_niah": backbone_niah(out)}
    (out / "leaderboard.json").write_text(json.dumps(results, indent=1))
    (out / "leaderboard.md").write_text(markdown(results))
    plot(results, out)
    return results


def backbone_niah(out: Path) -> dict | None:
    """scripts/pretrain_backbone.sh's S-NIAH score inside the backbone's window (its niah.json)."""
    path = out / "backbone" / "niah.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _cost(value, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def _zero_shot(summaries: dict | None) -> str:
    return "-" if not summaries else "; ".join(format_summary(s, 100) for s in summaries.values())


def markdown(results: dict) -> str:
    """One table (rows x metrics with intervals) and the hypotheses with their verdicts."""
    lengths = list(next(iter(results["rows"].values()))["ppl_by_length"]) if results["rows"] else []
    lines = [f"# Leaderboard: suite `{results['suite']}`", "",
             f"Training context {results['seq_len']} tokens, window {results['window']} tokens (grafts: the "
             f"backbone's {results['graft_window']}), "
             f"{results['training_tokens']:,} training tokens per from-scratch row (grafts: their configs' batches, the "
             f"same steps), seeds {results['seeds']}. Perplexity on "
             "held-out embedded-corpus documents by prefix length; recall: exact match beyond the window "
             "(S-NIAH, MK-NIAH, KV retrieval, BABILong qa1-qa5 at 2x-8x the window). 95% intervals over seeds, "
             "then items. Rows read chunk by chunk (streaming): "
             + ", ".join(n for n, r in results["rows"].items() if r["mode"] == "streaming") + "; sliding window: "
             + ", ".join(n for n, r in results["rows"].items() if r["mode"] == "sliding")
             + "; context written into a memory, then read after it (write_read): "
             + ", ".join(n for n, r in results["rows"].items() if r["mode"] == "write_read")
             + "; streamed with every block's attention bounded to the window (bounded_stream): "
             + ", ".join(n for n, r in results["rows"].items() if r["mode"] == "bounded_stream")
             + ". Zero-shot: lm-eval accuracy on each row's Hugging Face export (heldout_cloze: which of four "
               "endings continues a held-out passage, chance 25%; torchtitan_ext/eval/zero_shot.py).", "",
             "| row | mode | " + " | ".join(f"ppl @{n}" for n in lengths)
             + " | recall beyond window % | zero-shot % | train tok/s | eval tok/s | peak MB | state KB |",
             "| --- | --- | " + " | ".join("---" for _ in lengths) + " | --- | --- | --- | --- | --- | --- |"]
    for name, row in results["rows"].items():
        cost, recall = row["cost"]["mean"], row["recall_beyond_window"]
        lines.append(f"| {name} | {row['mode']} | " + " | ".join(format_summary(row["ppl_by_length"][n])
                                                                for n in lengths)
                     + f" | {format_summary(recall, 100) if recall else '-'}"
                     + f" | {_zero_shot(row['zero_shot'])} | {_cost(cost.get('train_tokens_per_s'))}"
                     + f" | {_cost(cost.get('eval_tokens_per_s'))} | {_cost(cost.get('peak_rss_bytes'), 2**20)}"
                     + f" | {_cost(cost.get('state_bytes'), 2**10, 1)} |")
    if niah := results["backbone_niah"]:
        lines += ["", f"The grafts' backbone (scripts/pretrain_backbone.sh, {niah['steps']} steps) on S-NIAH inside its "
                      f"{niah['window']}-token window: exact match {niah['exact_match']:.2f} "
                      f"({niah['interval'][0]:.2f}-{niah['interval'][1]:.2f}) over {niah['samples']} samples."]
    for title, key in (("Hypotheses (written before the run)", "hypotheses"),
                       ("Exploratory comparisons (added after a run, not written before it)", "exploratory")):
        lines += ["", f"## {title}", ""]
        for hypothesis in results[key]:
            lines.append(f"- **{hypothesis['claim']}**: {hypothesis['verdict']}")
            for c in hypothesis["comparisons"]:
                interval = "-" if c["ci95"] is None else f"{c['ci95'][0]:.3f} to {c['ci95'][1]:.3f}"
                lines.append(f"  - {c['model']} vs {c['control']}, {c['metric']} ({c['sense']}): {interval}: "
                             f"{c['verdict']}")
    return "\n".join(lines) + "\n"


def plot(results: dict, out: Path) -> None:
    """ppl_vs_length.png (pooled perplexity per prefix length) and recall_vs_length.png (exact
    match per length: every task pooled, and S-NIAH alone, the one task the grafts' backbone
    was trained on), one line per row, a dotted line at each window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, figure, panels in (("ppl_vs_length", _ppl_lines, 1), ("recall_vs_length", _recall_lines, 2)):
        fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4.5), squeeze=False)
        figure(results, *axes[0])
        for ax in axes[0]:
            ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)


def _ppl_lines(results: dict, ax) -> None:
    for name, row in results["rows"].items():
        lengths = [int(n) for n in row["ppl_by_length"]]
        ax.plot(lengths, [row["ppl_by_length"][str(n)]["pooled"] for n in lengths], marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="prefix length (tokens)", ylabel="perplexity")


def _recall_lines(results: dict, pooled_ax, niah_ax) -> None:
    for name, row in results["rows"].items():
        recall = row["recall_by_length"]
        lengths = sorted({int(n) for task in recall.values() for n in task})
        if lengths:
            pooled_ax.plot(lengths, [_pooled_mean(recall, str(n)) for n in lengths], marker="o", label=name)
            niah = {"s_niah": recall.get("s_niah", {})}  # nan where S-NIAH did not fit the length
            niah_ax.plot(lengths, [_pooled_mean(niah, str(n)) for n in lengths], marker="o", label=name)
    for ax, title in ((pooled_ax, "every task pooled"), (niah_ax, "S-NIAH")):
        for window in sorted({row["window"] for row in results["rows"].values()}):
            ax.axvline(window, color="grey", linestyle=":")
        ax.set(xscale="log", xlabel="context length (tokens; dotted: the windows)", ylabel="exact match",
               ylim=(-0.05, 1.05), title=title)


def _pooled_mean(recall: dict, length: str) -> float:
    found = [(task[length]["pooled"], sum(s["items"] for s in task[length]["per_seed"]))
             for task in recall.values() if length in task]
    return sum(v * n for v, n in found) / sum(n for _, n in found) if found else math.nan
