"""Does a learned prefix vector slow MQAR learning? The follow-up study behind issue 40's
question about Mela (`python scripts/mqar_prefix.py`).

Mela's memory-off twin with P 32, C 1 and a ReLU MLP is exactly the MLP-FFN LM reading one
learned vector before each sequence (docs/benchmarks.md "Initialisation and recall"): the
place of Mela's memory tokens (paper section 4.1). `PrefixLM` puts such a vector before any
suite row, so the same question can be asked of the Transformer++ and the MLP-FFN LM: does
the vector alone keep a model that learns MQAR without it from learning it within the
suite's budget? Each run trains one row at one seed as the suite does (`mqar_suite.train_run`:
its data, optimizer, schedule and validation prompts; `setting_with` changes the setting, e.g.
the step count or Mela's chunk shape) and records the validation curve and the validation
queries answered within and beyond the window. `summary` sets each prefixed setting beside the
plain one (solved counts, one-sided Fisher exact p). Findings: docs/benchmarks.md "The learned
prefix, tested".
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from torchtitan_ext.errors import UserError
from torchtitan_ext.eval import mqar, mqar_suite, mqar_verdicts
from torchtitan_ext.eval.stats import fisher_greater
from torchtitan_ext.training.checkpoints import causal_logits

SOLVED = 0.8  # validation accuracy at or above this counts as solved (the curves jump from ~0.3 to ~0.95)


class PrefixLM(torch.nn.Module):
    """`inner` (an LM with `tok_embeddings`) reading one learned vector before every sequence.

    forward: tokens (B, T) -> logits (B, T, vocab) of the real tokens. The inner model sees
    T + 1 positions; position 0's embedding is replaced by `prefix` (1, 1, dim), drawn from
    N(0, std) and trained with the rest (as Mela's `memory_init`, with weight decay).
    """

    def __init__(self, inner: torch.nn.Module, dim: int, std: float):
        super().__init__()
        self.inner = inner
        self.prefix = torch.nn.Parameter(torch.randn(1, 1, dim) * std)
        inner.tok_embeddings.register_forward_hook(self._put_prefix)

    def _put_prefix(self, module, args, embeddings: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.prefix.expand(embeddings.shape[0], 1, -1).to(embeddings.dtype), embeddings[:, 1:]], 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        placeholder = torch.zeros_like(tokens[:, :1])  # its embedding is replaced by the prefix
        return causal_logits(self.inner, torch.cat([placeholder, tokens], 1))[:, 1:]


def check_overrides(row: str, setting: mqar_suite.Setting, overrides: dict) -> None:
    """UserError naming the field when `overrides` has one the row's config lacks."""
    try:
        mqar_suite.build_row(row, setting, **overrides)
    except TypeError as e:
        raise UserError(f"--set: {row}'s config refuses {sorted(overrides)} ({e}): name fields of its config") from None


def validation_by_distance(model: torch.nn.Module, s: mqar_suite.Setting, seed: int) -> dict[str, dict[str, list[int]]]:
    """{str(kv): {str(distance): [right, asked]}}: the validation queries of each training task
    (`s.val_prompts` prompts) by how many tokens back their pair lies (`mqar.answers`)."""
    profile = {}
    for kv in s.train_kv:
        correct, distance = mqar.answers(model, *mqar_suite.prompts(s, kv, s.train_len, s.val_prompts, seed, "validation"))
        counts = profile.setdefault(str(kv), {})
        for d in sorted(set(distance.flatten().tolist())):
            at = distance == d
            counts[str(d)] = [int(correct[at].sum()), int(at.sum())]
    return profile


def split_at(window: int, *profiles: dict[str, list[int]]) -> tuple[list[int], list[int]]:
    """([right, asked] of the queries whose pair lies within `window` tokens, [right, asked] of
    the others: those no attention spanning `window` tokens reaches directly, so only a memory
    or stacked windows answer them), pooled over tasks' {str(distance): [right, asked]}. A
    chunk-local decoder (Mela's, P*C = mela_span) reaches only pairs in its own chunk."""
    inside, beyond = mqar_verdicts.distance_bins(
        ((int(d), right, asked) for profile in profiles for d, (right, asked) in profile.items()), (window,))
    return inside, beyond


def run(row: str, setting: mqar_suite.Setting, seed: int, lr: float, prefix_std: float | None,
        overrides: dict | None = None, loss_reach: int = 0, loss_reach_steps: int = 0) -> dict:
    """One run of `row` (a suite row) at `seed` and `lr`, with a prefix of std `prefix_std`
    (None: without one), config fields `overrides` and the loss asked only within
    `loss_reach` tokens (0: every query; `mqar.within_reach`) on the first `loss_reach_steps`
    steps (0: every step): its record (validation curve, last validation accuracy, seconds,
    the validation queries within and beyond the window, pooled and per training task, and
    by distance)."""
    overrides = overrides or {}

    def build(name: str, s: mqar_suite.Setting) -> torch.nn.Module:
        model = mqar_suite.build_row(name, s, **overrides)
        return model if prefix_std is None else PrefixLM(model, s.width, prefix_std)

    model, record = mqar_suite.train_run(row, setting, seed, lr, build=build, loss_reach=loss_reach,
                                         loss_reach_steps=loss_reach_steps)
    profile = validation_by_distance(model.eval(), setting, seed)
    inside, beyond = split_at(setting.window, *profile.values())
    return {"row": row, "prefix_std": prefix_std, "overrides": overrides, "setting_changes": setting_changes(setting),
            "loss_reach": loss_reach, "loss_reach_steps": loss_reach_steps, "seed": seed, "lr": lr, "steps": setting.steps,
            "parameters": sum(p.numel() for p in model.parameters()),
            "curve": record["curve"], "stop": record["stop"], "stop_step": record["stop_step"],
            "val_accuracy": record["val_accuracy"],
            "solved": record["val_accuracy"] >= SOLVED, "within_window": inside, "beyond_window": beyond,
            "within_window_by_kv": {kv: split_at(setting.window, counts)[0] for kv, counts in profile.items()},
            "by_distance": profile,
            "train_seconds": record["train_seconds"]}


def run_all(row: str, setting: mqar_suite.Setting, seeds: list[int], lr: float, prefix_std: float | None,
            overrides: dict, out: Path, log=print, loss_reach: int = 0, loss_reach_steps: int = 0) -> list[dict]:
    """`run` for each seed, each record appended to the JSON-lines file `out` as it ends
    (a seed already there with the same row, prefix, overrides, setting, steps, lr and loss
    reach and its steps is skipped; a record from before those existed has 0 for them)."""
    done = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    key = dict(row=row, prefix_std=prefix_std, overrides=overrides, setting_changes=setting_changes(setting),
               steps=setting.steps, lr=lr, loss_reach=loss_reach, loss_reach_steps=loss_reach_steps)
    absent = {"loss_reach": 0, "loss_reach_steps": 0}
    records = []
    for seed in seeds:
        previous = [r for r in done if r["seed"] == seed and all(r.get(k, absent.get(k, {})) == v for k, v in key.items())]
        record = previous[0] if previous else run(row, setting, seed, lr, prefix_std, overrides, loss_reach,
                                                  loss_reach_steps)
        if not previous:
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
        records.append(record)
        log(f"{row} prefix {prefix_std} seed {seed}: validation {record['val_accuracy']:.3f} "
            f"(curve {' '.join(f'{a:.2f}' for _, a in record['curve'])}; {record['train_seconds']:.0f} s)")
    return records


def summary(records: list[dict]) -> str:
    """A markdown table of `records` (from `run_all`'s file): per row, step count, lr and
    overrides, one line per prefix setting with each seed's validation accuracy, the solved
    count and, for a prefixed line, the one-sided Fisher exact p that the same row without a
    prefix solves more often (stats.fisher_greater; "-" without such a line)."""
    groups: dict[str, dict] = {}
    for r in sorted(records, key=lambda r: (r["row"], r["steps"], r["prefix_std"] is not None, r["prefix_std"] or 0, r["seed"])):
        changes = {**r["overrides"], **{f"setting.{k}": v for k, v in r.get("setting_changes", {}).items()}}
        setting = f"{r['row']} | {r['steps']} | {r['lr']:g} | {json.dumps(changes) if changes else '-'}"
        groups.setdefault(setting, {}).setdefault(r["prefix_std"], []).append(r)
    lines = ["| row | steps | lr | overrides | prefix std | validation accuracy by seed | solved (>= 0.8) | Fisher p, without > with |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for setting, by_prefix in groups.items():
        without = by_prefix.get(None)
        for std, runs in by_prefix.items():
            solved = sum(r["solved"] for r in runs)
            p = "-" if std is None or without is None else \
                f"{fisher_greater(sum(r['solved'] for r in without), len(without), solved, len(runs)):.3g}"
            seeds = ", ".join(f"{r['seed']}: {r['val_accuracy']:.2f}" for r in runs)
            lines.append(f"| {setting} | {'none' if std is None else f'{std:g}'} | {seeds} | {solved} of {len(runs)} | {p} |")
    return "\n".join(lines)


def setting_with(quick: bool, **changes) -> mqar_suite.Setting:
    """The suite's full (or quick) setting with `changes` to its fields (steps, window,
    mela_patch, ...); UserError naming a field it lacks or a combination it refuses."""
    try:
        return dataclasses.replace(mqar_suite.SETTINGS["quick" if quick else "full"], **changes)
    except (TypeError, ValueError) as e:
        raise UserError(f"--setting {changes}: {e}") from None


def setting_changes(setting: mqar_suite.Setting) -> dict:
    """The fields `setting` changes from the suite setting of its name, steps aside (recorded apart)."""
    base = mqar_suite.SETTINGS[setting.name]
    return {f.name: getattr(setting, f.name) for f in dataclasses.fields(setting)
            if f.name != "steps" and getattr(setting, f.name) != getattr(base, f.name)}
