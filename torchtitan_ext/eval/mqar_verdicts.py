"""Statistics and verdicts of the MQAR suite, from its JSON alone (mqar.json; the protocol:
torchtitan_ext/eval/mqar_suite.py's docstring).

Verdicts (`verdict`, `verdicts`): per hypothesis and task, never pooled across tasks. A task on
which every row's pooled accuracy is at most the floor is "at floor" and has no verdict; so is
a comparison whose rows are both at most the floor on that task. "at_least" (a row's accuracy
a, threshold t, tolerance e): supported when the interval's low end is >= t - e, not supported
when its high end is < t - e. "better" (paired difference d = model - control, tolerance e,
smallest effect s > e): supported when low > e, not supported when high < s; anything else is
inconclusive.

No control, no verdict: a hypothesis with `control_inside` set (those that set a memory row
against the window-only Transformer++) gets a verdict on a task only where its control answers
at least that share of the task's queries inside its window (key-to-query distance <= window;
every seed and prompt of the task pooled: `inside_share`). Otherwise the verdict reads "no
control (window-only control answers X inside its window < 0.9)": a control that has not
learned the recall it can reach would turn "memory beats window" into "memory learned, control
did not". The share is taken per task, not pooled over tasks, so a control that solves short
prompts but not long ones yields verdicts only where it holds.

Reaching a level (`reach`): the first evaluation of a run's validation curve at or above each
of `LEVELS`, as steps and as training FLOPs (steps x batch x training length x the row's
measured training FLOPs per token); None where the run never got there.

Sample efficiency (`efficiency_verdict`, metric "flops_to_level"): per seed both rows ran (the
same training batches: seeded alike), the gain g = log2(control's training FLOPs to the level /
the model's), +inf where only the model reached the level before its stop, -inf where only the
control did; a seed where neither did carries no information on the level and is left out.
The estimate is the median gain over those seeds (the lower middle one for an even count: the
smaller gain, so the rule leans against the model), its interval a bootstrap over them; the
"better" rule then reads it in log2 units (supported when low > tolerance, not supported when
high < smallest effect). "Never reached" means before the run's own stop (plateau or cap), not
"never": an infinite gain is a censored one. No seed where either row reached it: "neither
reaches <level>", no verdict.
"""

from __future__ import annotations

import math

import torch

from torchtitan_ext.eval.stats import _percentiles, seed_item_bootstrap, summarize_seeds

RESAMPLES = 2000
LEVELS = (0.5, 0.8, 0.99)


def task_key(kv: int, length: int) -> str:
    return f"kv{kv}_len{length}"


def prompt_values(row: dict, key: str) -> list[list[float]]:
    """Per seed (in seed order), each prompt's share of queries answered right on task `key`."""
    return [[sum(q) / len(q) for q in row["seeds"][seed]["tasks"][key]["correct"]]
            for seed in sorted(row["seeds"], key=int)]


def summaries(results: dict) -> dict:
    """{row: {task: summarize_seeds of its per-prompt accuracy}}."""
    return {name: {key: summarize_seeds(prompt_values(row, key), resamples=RESAMPLES)
                   for key in next(iter(row["seeds"].values()))["tasks"]}
            for name, row in results["rows"].items()}


def distance_bins(counted, edges: tuple[int, ...]) -> list[list[int]]:
    """[right, asked] per distance bin of `counted`, (distance, right, asked) triples: d <=
    edges[0], edges[0] < d <= edges[1], ..., d > edges[-1] (len(edges) + 1 bins)."""
    counts = [[0, 0] for _ in range(len(edges) + 1)]
    for d, right, asked in counted:
        side = counts[sum(d > edge for edge in edges)]
        side[0] += right
        side[1] += asked
    return counts


def binned_counts(row: dict, edges: tuple[int, ...], length: int | None = None, key: str | None = None) -> list[list[int]]:
    """[right, asked] per distance bin (`distance_bins`) of the row's queries (every seed and
    prompt) by how many tokens back their pair lies; only tasks of length `length` (None: all),
    or only task `key`."""
    tasks = [task for seed in row["seeds"].values() for name, task in seed["tasks"].items()
             if (length is None or task["length"] == length) and (key is None or name == key)]
    return distance_bins(((d, ok, 1) for task in tasks for right, far in zip(task["correct"], task["distance"])
                          for ok, d in zip(right, far)), edges)


def split_counts(row: dict, window: int, length: int | None = None, key: str | None = None) -> dict:
    """{"inside": [right, asked], "beyond": [right, asked]}: the row's queries (every seed and
    prompt) whose pair lies <= `window` tokens back, and the others; only tasks of length
    `length` (None: all), or only task `key`."""
    inside, beyond = binned_counts(row, (window,), length, key)
    return {"inside": inside, "beyond": beyond}


def distance_edges(window: int) -> tuple[int, ...]:
    """The report's distance bins for a window w: a quarter, half, three quarters of it, the
    window, the reach of two stacked windows 2(w - 1) (a query at position t sees t - w + 1; a
    position there saw w - 1 further back), beyond."""
    return tuple(sorted({max(1, window // 4), max(1, window // 2), max(1, 3 * window // 4), window,
                         max(window, 2 * (window - 1))}))


def by_distance(results: dict) -> dict:
    """Exploratory (added after the first run was started, not a hypothesis): per row, the
    share of queries answered right at the training length, every key-value count and seed
    pooled, split by the key's distance: within the window (<= window tokens back, where the
    windowed rows' attention reaches the pair's value) and beyond it. {row: {"inside": [right,
    asked], "beyond": [right, asked]}}."""
    s = results["setting"]
    return {name: split_counts(row, s["window"], length=s["train_len"]) for name, row in results["rows"].items()}


def inside_share(results: dict, row: str, key: str) -> float | None:
    """Share of task `key`'s queries within the window that `row` answers (every seed and
    prompt pooled); None when the task has no such query."""
    right, asked = split_counts(results["rows"][row], results["setting"]["window"], key=key)["inside"]
    return right / asked if asked else None


def floor_tasks(results: dict, table: dict) -> list[str]:
    """Tasks on which every row's pooled accuracy is at most the floor."""
    keys = next(iter(table.values())).keys() if table else []
    return [k for k in keys if all(table[row][k]["pooled"] <= results["floor"] for row in table)]


def verdict(h: dict, interval: tuple[float, float]) -> str:
    """The module docstring's rule for one hypothesis (its JSON dict) on one task's interval."""
    low, high = interval
    if h["sense"] == "at_least":
        bar = h["threshold"] - h["tolerance"]
        return "supported" if low >= bar else "not supported" if high < bar else "inconclusive"
    if h["sense"] == "better":
        return ("supported" if low > h["tolerance"] else "not supported" if high < h["smallest_effect"]
                else "inconclusive")
    raise ValueError(f"unknown sense {h['sense']}")


def in_scope(h: dict, length: int, train_len: int) -> bool:
    """Whether a task of `length` is in hypothesis `h`'s scope ("trained", "past" or "all")."""
    return {"trained": length == train_len, "past": length > train_len, "all": True}[h["lengths"]]


def verdicts(results: dict) -> list[dict]:
    """Every hypothesis answered on every task in its scope, from the JSON's items alone."""
    table = summaries(results)
    floored = set(floor_tasks(results, table))
    out = []
    for h in results["hypotheses"]:
        rows = [h["model"]] + ([h["control"]] if h["control"] else [])
        if any(r not in results["rows"] for r in rows):
            out.append({"hypothesis": h["key"], "task": None, "verdict": "not run", "ci95": None, "estimate": None})
            continue
        if h["metric"] == "flops_to_level":
            out.append(efficiency_verdict(h, results["rows"][h["model"]], results["rows"][h["control"]]))
            continue
        for key, task in next(iter(results["rows"][h["model"]]["seeds"].values()))["tasks"].items():
            if not in_scope(h, task["length"], results["setting"]["train_len"]):
                continue
            model = prompt_values(results["rows"][h["model"]], key)
            if h["control"]:
                control = prompt_values(results["rows"][h["control"]], key)
                values = [[a - b for a, b in zip(m, c)] for m, c in zip(model, control)]
            else:
                values = model
            estimate = sum(map(sum, values)) / sum(map(len, values))
            interval = seed_item_bootstrap(values, resamples=RESAMPLES)
            bar = h.get("control_inside")
            share = inside_share(results, h["control"], key) if bar is not None else None
            if key in floored:
                answer = "at floor (task)"
            elif h["control"] and all(table[r][key]["pooled"] <= results["floor"] for r in rows):
                answer = "at floor (both rows)"
            elif bar is not None and share is None:
                answer = "no control (no query inside the window)"
            elif bar is not None and share < bar:
                answer = f"no control (window-only control answers {share:.2f} inside its window < {bar:g})"
            else:
                answer = verdict(h, interval)
            out.append({"hypothesis": h["key"], "task": key, "estimate": estimate, "ci95": list(interval),
                        "ci_width": interval[1] - interval[0], "verdict": answer, "control_inside": share})
    return out


def reach(curve: list, tokens_per_step: int, flops_per_token: float) -> dict:
    """{str(level): {"step", "train_flops"} or None} for each of LEVELS: the first point of
    `curve` ([step, accuracy] pairs, in step order) whose accuracy is >= level; train_flops =
    step x tokens_per_step x flops_per_token."""
    out = {}
    for level in LEVELS:
        step = next((s for s, a in curve if a >= level), None)
        out[str(level)] = None if step is None else {"step": step, "train_flops": step * tokens_per_step * flops_per_token}
    return out


def level_gains(model: dict, control: dict, level: float) -> list[float]:
    """Per seed both rows ran (seed order): log2(control's training FLOPs to `level` / the
    model's), +inf / -inf where only the model / only the control reached it; seeds where
    neither did are left out (module docstring)."""
    gains = []
    for seed in sorted(set(model["seeds"]) & set(control["seeds"]), key=int):
        ours, theirs = (row["seeds"][seed]["reach"][str(level)] for row in (model, control))
        if ours is None and theirs is None:
            continue
        gains.append(math.inf if theirs is None else -math.inf if ours is None else
                     math.log2(theirs["train_flops"] / ours["train_flops"]))
    return gains


def lower_median(values: torch.Tensor) -> torch.Tensor:
    """The median along the last dimension, the lower middle value for an even count (infinities allowed)."""
    return values.sort(-1).values[..., (values.shape[-1] - 1) // 2]


def median_interval(values: list[float], resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of `lower_median` of `values` (resampled with replacement)."""
    data = torch.tensor(values, dtype=torch.float64)
    picks = torch.randint(0, len(data), (resamples, len(data)), generator=torch.Generator().manual_seed(seed))
    return _percentiles(lower_median(data[picks]))


def efficiency_verdict(h: dict, model: dict, control: dict) -> dict:
    """A "flops_to_level" hypothesis answered on the two rows' validation curves (module docstring)."""
    level = h["threshold"]
    gains = level_gains(model, control, level)
    task = f"validation {level:g}"
    if not gains:
        return {"hypothesis": h["key"], "task": task, "estimate": None, "ci95": None, "verdict": f"neither reaches {level:g}",
                "paired_seeds": 0}
    estimate = lower_median(torch.tensor(gains, dtype=torch.float64)).item()
    low, high = median_interval(gains)
    return {"hypothesis": h["key"], "task": task, "estimate": estimate, "ci95": [low, high],
            "ci_width": 0.0 if low == high else high - low, "verdict": verdict({**h, "sense": "better"}, (low, high)),
            "paired_seeds": len(gains)}
