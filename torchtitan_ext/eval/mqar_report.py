"""The MQAR suite's report: mqar.md (headline, plateau table, accuracy per task, hypotheses and
verdicts, cost, learning-rate sweep, the by-distance split) and its figures, from the JSON
alone (torchtitan_ext/eval/mqar_suite.py writes it; mqar_verdicts.py answers it).

`plot`: accuracy by length, a panel per key-value count. `plot_flops`: validation accuracy
against training FLOPs (steps x batch x training length x the row's measured training FLOPs
per token), a panel per training task, one line per row (the median over seeds) and a band
from the lowest to the highest seed; a run that stopped (plateau, target, non-finite) holds its
last accuracy to the right of its stop, so the band spans every seed to the longest run.
"""

from __future__ import annotations

from pathlib import Path

from torchtitan_ext.eval.mqar_verdicts import LEVELS, binned_counts, by_distance, distance_edges, task_key
from torchtitan_ext.eval.stats import format_summary


def _si(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def headline(results: dict) -> list[str]:
    """The headline table: row, cost, accuracy at the training length per key-value count
    (interval over seeds then prompts), accuracy at the longest length, verdicts naming the row."""
    s = results["setting"]
    trained = [task_key(kv, s["train_len"]) for kv in s["eval_kv"] if 4 * kv <= s["train_len"]]
    longest = max(s["eval_lengths"])
    past = [task_key(kv, longest) for kv in s["eval_kv"] if 4 * kv <= longest]
    by_row: dict[str, list[str]] = {}
    for v in results["verdicts"]:
        h = next(h for h in results["hypotheses"] if h["key"] == v["hypothesis"])
        if v["task"]:
            by_row.setdefault(h["model"], []).append(f"{h['key']} {v['task'].replace('_len', '@')}: {v['verdict']}")
    lines = ["| row | best lr | params | train FLOPs/tok | tok/s | state | "
             + " | ".join(f"acc {k.replace('_len', ' @')}" for k in trained)
             + " | " + " | ".join(f"acc {k.replace('_len', ' @')}" for k in past) + " | verdicts (model side) |",
             "| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in trained + past) + " | --- |"]
    for name, row in results["rows"].items():
        c = row["cost"]
        cells = [format_summary(results["summary"][name][k], digits=2) for k in trained + past]
        lines.append(f"| {name} | {row['best_lr']:g} | {_si(c['trainable_params'])} | {_si(c['train_flops_per_token'])} | "
                     f"{c['train_tokens_per_s']:,.0f} | {_si(c['state_bytes'])}B | " + " | ".join(cells)
                     + f" | {'; '.join(by_row.get(name, [])) or '-'} |")
    lines += [f"| {name} | {not_run(results, name)} | " + " | ".join("-" for _ in range(5 + len(trained + past))) + " |"
              for name in results.get("not_run", {})]
    return lines


def not_run(results: dict, name: str) -> str:
    """A row of the suite with no finished row in the results, in words (its runs done so far)."""
    counts = results["not_run"][name]
    return f"not run (runs done {counts['runs_done']} of {counts['runs_needed']})"


def stops(row: dict) -> str:
    """Each seed's accuracy at its stop, the step and the reason ("non-finite" where it went so)."""
    runs = [row["seeds"][k] for k in sorted(row["seeds"], key=int)]
    return "; ".join(f"{r['seed']}: " + ("non-finite" if r["plateau_accuracy"] is None else f"{r['plateau_accuracy']:.2f}")
                     + f" ({r['stop_step']}, {r['stop']})" for r in runs)


def first_screen(results: dict) -> list[str]:
    """The short plateau table (docs/leaderboard.md's first screen): per row of the suite, the
    chosen lr, each seed's validation accuracy at its stop (step, reason), the median over seeds
    of that accuracy, the training FLOPs to 0.8 (median over the seeds that reached it, and how
    many did) and the test accuracy at the training length per key-value count (pooled over
    seeds); rows not run say so."""
    s = results["setting"]
    trained = [task_key(kv, s["train_len"]) for kv in s["eval_kv"] if 4 * kv <= s["train_len"]]
    lines = ["| row | lr | seed: validation acc. at stop (step, why) | median | train FLOPs to 0.8 (seeds) | "
             + " | ".join(f"test {k.replace('_len', ' @')}" for k in trained) + " |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in trained) + " |"]
    for name in [*results["rows"], *results.get("not_run", {})]:
        if name not in results["rows"]:
            lines.append(f"| {name} | - | {not_run(results, name)} | - | - | " + " | ".join("-" for _ in trained) + " |")
            continue
        row = results["rows"][name]
        runs = list(row["seeds"].values())
        finals = sorted(-1.0 if r["plateau_accuracy"] is None else r["plateau_accuracy"] for r in runs)
        reached = sorted(r["reach"]["0.8"]["train_flops"] for r in runs if r["reach"]["0.8"] is not None)
        to_08 = f"{_si(reached[(len(reached) - 1) // 2])} ({len(reached)} of {len(runs)})" if reached else f"- (0 of {len(runs)})"
        median = finals[(len(finals) - 1) // 2]
        lines.append(f"| {name} | {row['best_lr']:g} | {stops(row)} | {'non-finite' if median < 0 else f'{median:.2f}'} | "
                     f"{to_08} | " + " | ".join(f"{results['summary'][name][k]['pooled']:.2f}" for k in trained) + " |")
    return lines


def budget(s: dict) -> str:
    """The training budget of setting `s` (its JSON dict) in words."""
    if not s.get("cap_factor"):
        return (f"{s['steps']} steps of {s['batch_size']} ({s['steps'] * s['batch_size'] * s['train_len']:,} training "
                f"tokens a run)")
    return (f"trained to the plateau, batches of {s['batch_size']}: validation accuracy every {s['eval_every']} steps, "
            f"stop at 0.99, at no gain above 0.01 over {s['plateau_window']} evaluations, or at the cap of "
            f"{s['cap_factor']} x {s['steps']} steps")


def plateau_table(results: dict) -> list[str]:
    """Per row: each seed's accuracy at its stop (validation, the training tasks' mean), the
    step and reason it stopped, and its steps and training FLOPs to each of LEVELS ("-":
    never); the sweep's other rates are left out (their runs: the JSON's "sweep")."""
    lines = ["| row | lr | seed: plateau accuracy (stopped at step, why) | " + " | ".join(
        f"steps; FLOPs to {level:g} by seed" for level in LEVELS) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in LEVELS) + " |"]
    for name, row in results["rows"].items():
        runs = [row["seeds"][k] for k in sorted(row["seeds"], key=int)]
        reached = [", ".join("-" if r["reach"][str(level)] is None else
                             f"{r['reach'][str(level)]['step']}; {_si(r['reach'][str(level)]['train_flops'])}" for r in runs)
                   for level in LEVELS]
        lines.append(f"| {name} | {row['best_lr']:g} | {stops(row)} | " + " | ".join(reached) + " |")
    lines += [f"| {name} | - | {not_run(results, name)} | " + " | ".join("-" for _ in LEVELS) + " |"
              for name in results.get("not_run", {})]
    return lines


def markdown(results: dict) -> str:
    s = results["setting"]
    lines = [f"# MQAR suite ({results['date']}, setting `{s['name']}`)", "",
             f"Width {s['width']}, {s['layers']} layers, vocabulary {s['vocab']}, trained at length {s['train_len']} on "
             f"{list(s['train_kv'])} key-value pairs, window {s['window']} for the windowed rows (Mela's decoder chunk "
             f"{s['mela_span']}), {budget(s)}, seeds {list(s['seeds'])}, {s['test_prompts']} test prompts per task and "
             f"seed (drawn per seed), answered by each run's model as it stopped. "
             f"LR grid {results['lr_grid']}: {results['selection']}. Accuracy: share of queries answered right, "
             f"pooled (95% interval over seeds, then prompts); seeds. At floor (every row <= {results['floor']}): "
             f"{', '.join(results['floor_tasks']) or 'none'}.", "", *first_screen(results), "", *headline(results), "",
             "## Plateau: where each run stopped, and what reaching each level cost", "",
             "Training FLOPs = steps x batch x training length x the row's measured training FLOPs per token; "
             "the levels are validation accuracy, read at the evaluations (accuracy vs FLOPs: mqar_flops.png).", "",
             *plateau_table(results), "", "## Accuracy per task", ""]
    keys = list(next(iter(results["summary"].values())))
    lines += ["| row | " + " | ".join(k.replace("_len", " @") for k in keys) + " |",
              "| --- | " + " | ".join("---" for _ in keys) + " |"]
    for name, table in results["summary"].items():
        lines.append(f"| {name} | " + " | ".join(format_summary(table[k], digits=2) for k in keys) + " |")
    lines += ["", "## Hypotheses (written before the run) and verdicts per task", ""]
    for h in results["hypotheses"]:
        rule = (f"accuracy >= {h['threshold']} (tolerance {h['tolerance']})" if h["sense"] == "at_least" else
                f"log2 of {h['control']}'s training FLOPs to validation {h['threshold']:g} over {h['model']}'s, median "
                f"over the seeds where either reached it, > {h['tolerance']} (supported), < {h['smallest_effect']} ruled "
                f"out (not supported); inf: only {h['model']} reached it" if h["metric"] == "flops_to_level" else
                f"paired difference {h['model']} - {h['control']} > {h['tolerance']} (supported), "
                f"< {h['smallest_effect']} ruled out (not supported)")
        control = ("" if h.get("control_inside") is None else
                   f"; a verdict only where {h['control']} answers >= {h['control_inside']:g} of the task's queries "
                   f"inside its window")
        lines.append(f"- **{h['key']}: {h['claim']}** ({rule}; lengths: {h['lengths']}; expected 95% width "
                     f"{h['expected_width']}{control})")
        for v in results["verdicts"]:
            if v["hypothesis"] == h["key"]:
                interval = "-" if v["ci95"] is None else (f"{v['estimate']:.3f} ({v['ci95'][0]:.3f} to {v['ci95'][1]:.3f}, "
                                                          f"width {v['ci_width']:.3f})")
                seeds = f" ({v['paired_seeds']} seeds)" if "paired_seeds" in v else ""
                lines.append(f"  - {v['task']}{seeds}: {interval}: {v['verdict']}")
    lines += ["", "## Cost", "", "| row | training tokens (mean a run) | trainable params | train FLOPs/token (measured; analytic) | "
              "eval FLOPs/token | train wall s (per run) | train tokens/s | memory state bytes |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in results["rows"].items():
        c = row["cost"]
        lines.append(f"| {name} | {c['training_tokens']:,.0f} | {c['trainable_params']:,} | {_si(c['train_flops_per_token'])}; "
                     f"{_si(c['analytic_train_flops_per_token'])} | {_si(c['eval_flops_per_token'])} | "
                     f"{c['train_seconds']:.0f} | {c['train_tokens_per_s']:,.0f} | {c['state_bytes']:,} |")
    lines += ["", "## Learning-rate sweep (validation accuracy, first seed)", "",
              "| row | " + " | ".join(f"lr {lr:g}" for lr in results["lr_grid"]) + " | chosen |",
              "| --- | " + " | ".join("---" for _ in results["lr_grid"]) + " | --- |"]
    for name, row in results["rows"].items():
        cells = [f"{r['val_accuracy']:.3f}" + (f" (non-finite at {r['nonfinite_step']})" if r["nonfinite_step"] else "")
                 for r in row["sweep"]]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['best_lr']:g} |")
    split = by_distance(results)
    lines += ["", f"## Exploratory: by the key's distance (training length {s['train_len']}, window {s['window']})", "",
              "Added after the run was started, not a hypothesis: queries whose pair lies within the window (<= "
              f"{s['window']} tokens back) and beyond it, every key-value count and seed pooled (queries, not "
              "independent items: no interval). Mela's window is its decoder chunk and MAC's its segment, so their "
              "split is approximate.", "", "| row | within the window | beyond the window |", "| --- | --- | --- |"]
    for name, counts in split.items():
        cells = [f"{c[0] / c[1]:.3f} ({c[1]:,} queries)" if c[1] else "-" for c in (counts["inside"], counts["beyond"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    edges = distance_edges(s["window"])
    bins = [f"<= {edges[0]}"] + [f"{a + 1}-{b}" for a, b in zip(edges, edges[1:])] + [f"> {edges[-1]}"]
    lines += ["", f"The same queries by the pair's distance in tokens (the near pairs apart from the far ones: a "
              f"windowed model that recalls through its two stacked windows can serve d up to 2 x ({s['window']} - 1) "
              "and still fail the nearest pairs):", "", "| row | " + " | ".join(bins) + " |",
              "| --- | " + " | ".join("---" for _ in bins) + " |"]
    for name, row in results["rows"].items():
        cells = [f"{right / asked:.2f} ({asked:,})" if asked else "-"
                 for right, asked in binned_counts(row, edges, length=s["train_len"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Wall times and tokens/s are single timings on a shared 2-core machine (no interval)."]
    return "\n".join(lines) + "\n"


def _figure(panels: int, rows: int):
    """(pyplot, figure, its `panels` axes in a row, a colour for each of `rows` rows: tab10's,
    then tab20's lighter tints, repeated past 20 rather than a row left out); Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    palette = [*plt.get_cmap("tab10").colors, *plt.get_cmap("tab20").colors[1::2]]
    return plt, fig, axes[0], [palette[i % len(palette)] for i in range(rows)]


def _save(plt, fig, axes, path: Path) -> None:
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(results: dict, path: Path) -> None:
    """Accuracy by length, one panel per key-value count, every row its own colour."""
    s = results["setting"]
    plt, fig, axes, colours = _figure(len(s["eval_kv"]), len(results["summary"]))
    for ax, kv in zip(axes, s["eval_kv"]):
        for colour, (name, table) in zip(colours, results["summary"].items()):
            lengths = [n for n in s["eval_lengths"] if task_key(kv, n) in table]
            if not lengths:
                continue
            pooled = [table[task_key(kv, n)]["pooled"] for n in lengths]
            low = [table[task_key(kv, n)]["ci95"][0] for n in lengths]
            high = [table[task_key(kv, n)]["ci95"][1] for n in lengths]
            ax.errorbar(lengths, pooled, yerr=[[p - lo for p, lo in zip(pooled, low)], [hi - p for p, hi in zip(pooled, high)]],
                        marker="o", color=colour, label=name, capsize=2)
        ax.axvline(s["train_len"], color="grey", linestyle=":")
        ax.set(xscale="log", xlabel="sequence length (dotted: trained)", ylabel="accuracy", ylim=(-0.05, 1.05),
               title=f"{kv} key-value pairs")
    _save(plt, fig, axes, path)


def plot_flops(results: dict, path: Path) -> None:
    """Validation accuracy against training FLOPs, a panel per training task (key-value count
    at the training length): per row the median over seeds (the lower middle one for an even
    count) and a band from the lowest to the highest seed (module docstring: a stopped run
    holds its last accuracy)."""
    s = results["setting"]
    plt, fig, axes, colours = _figure(len(s["train_kv"]), len(results["rows"]))
    for ax, kv in zip(axes, s["train_kv"]):
        for colour, (name, row) in zip(colours, results["rows"].items()):
            per_step = row["cost"]["train_flops_per_token"] * s["batch_size"] * s["train_len"]
            curves = [{step: scores[str(kv)] for step, scores in run["curve_by_kv"]} for run in row["seeds"].values()]
            steps = sorted({step for curve in curves for step in curve})
            if not steps:
                continue
            held = [[_held(curve, step) for curve in curves] for step in steps]
            flops = [step * per_step for step in steps]
            ax.plot(flops, [sorted(v)[(len(v) - 1) // 2] for v in held], color=colour, label=name)
            ax.fill_between(flops, [min(v) for v in held], [max(v) for v in held], color=colour, alpha=0.2)
        ax.set(xscale="log", xlabel="training FLOPs", ylabel="validation accuracy", ylim=(-0.05, 1.05),
               title=f"{kv} key-value pairs at length {s['train_len']}")
    _save(plt, fig, axes, path)


def _held(curve: dict, step: int) -> float:
    """A run's accuracy at `step`: its evaluation there, else its last one before (a stopped
    run holds its last accuracy); 0 before its first evaluation."""
    earlier = [s for s in curve if s <= step]
    return curve[max(earlier)] if earlier else 0.0
