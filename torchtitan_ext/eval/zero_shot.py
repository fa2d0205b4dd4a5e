"""Zero-shot multiple-choice scores of a Hugging Face export through EleutherAI's
lm-evaluation-harness (the `eval` extra), per question, and the local task the leaderboard's
small suites score offline.

- `run_lm_eval(folder, tasks, ...)`: lm_eval's "hf" model on one export folder
  (`trust_remote_code`, so the project's own families load through their exported code), its
  logged samples -> {(task, doc_id): acc}, 0/1 per question.
- `write_cloze_task(folder, items, seed)`: a tiny multiple-choice task, "heldout_cloze",
  written as an lm-eval YAML task over a local jsonl (no download): each question is a
  passage of the held-out prose (the embedded corpus' held-out documents, the text the
  needle tasks' "text" haystack reads and no training row holds), CLOZE_CONTEXT characters,
  and four endings of CLOZE_ENDING characters: its own continuation and three from other
  places of the held-out prose, cut at words. Scored by lm-eval's `acc` (the ending of
  highest log-likelihood), chance 0.25. A choice where the papers are silent: the fla suite
  (PAPER_TASKS) needs the Hub; this task keeps the same kind of question (which ending
  follows?) on text every row can read inside its window.
- PAPER_TASKS: the `paper` suite's list (flash-linear-attention's zero-shot suite), and
  PAPER_RULER the RULER needle lengths, for users with the Hub.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

from torchtitan_ext.errors import UserError

PAPER_TASKS = ("wikitext", "lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge")
PAPER_RULER = ("niah_single_1", (4096, 8192, 16384, 32768))  # lm-eval's `ruler` group, max_seq_lengths
CLOZE_TASK = "heldout_cloze"
CLOZE_CONTEXT = 240  # characters of passage before the endings
CLOZE_ENDING = 48  # characters of each ending
CLOZE_YAML = f"""task: {CLOZE_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {{data}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: endings
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _cut(text: str, start: int, size: int) -> str:
    """About `size` characters of `text` from `start`, ending before a word."""
    piece = text[start:start + size + 1]
    return piece.rsplit(" ", 1)[0] if " " in piece else piece[:size]


def cloze_items(items: int, seed: int) -> list[dict]:
    """`items` questions {"context", "endings" (4), "label"} from the held-out prose (module
    docstring), the same for the same (items, seed)."""
    from torchtitan_ext.data.synthetic_tasks import heldout_sentences

    text = " ".join(heldout_sentences())
    rng = random.Random(f"cloze-{seed}")
    span = CLOZE_CONTEXT + CLOZE_ENDING
    out = []
    for _ in range(items):
        start = text.index(" ", rng.randrange(len(text) - 2 * span)) + 1
        context = _cut(text, start, CLOZE_CONTEXT)
        true_ending = " " + _cut(text, start + len(context) + 1, CLOZE_ENDING)
        others = []
        while len(others) < 3:
            at = text.index(" ", rng.randrange(len(text) - 2 * span)) + 1
            if abs(at - start) > span:
                others.append(" " + _cut(text, at, CLOZE_ENDING))
        label = rng.randrange(4)
        endings = others[:label] + [true_ending] + others[label:]
        out.append({"context": context, "endings": endings, "label": label})
    return out


def write_cloze_task(folder: Path, items: int = 64, seed: int = 0) -> Path:
    """Write the heldout_cloze lm-eval task (module docstring) into `folder` (its
    `--include_path`); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{CLOZE_TASK}.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in cloze_items(items, seed)))
    (folder / f"{CLOZE_TASK}.yaml").write_text(CLOZE_YAML.format(data=data.resolve()))
    return folder


@functools.cache
def _task_index(include_path: str | None, include_defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def task_manager(tasks: list[str], include_path: str | None):
    """lm_eval's TaskManager for `tasks`, built once per process: its index of lm_eval's own
    task YAML (thousands of files) takes ~27 s on 2 CPU cores, so when include_path holds
    every task named as a task (a group or tag there may name lm_eval's own tasks), only
    include_path is indexed."""
    if include_path:
        local = _task_index(include_path, False)
        if set(tasks) <= set(local.all_subtasks):
            return local
    return _task_index(include_path, True)


def run_lm_eval(folder: Path, tasks: str, include_path: str | None, device: str, dtype: str,
                limit: int | None) -> dict[tuple[str, int], float]:
    """lm_eval (`simple_evaluate`, in this process: its import and task index once, not per
    model) on one model folder -> {(task, doc_id): acc} from its logged samples (a group such
    as mmlu: its subtasks); UserError naming lm_eval's error when it fails, or when no task
    logged a per-question `acc`."""
    from lm_eval import simple_evaluate

    try:
        names = tasks.split(",")
        results = simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype={dtype},trust_remote_code=True",
                                  tasks=names, task_manager=task_manager(names, include_path),
                                  device=device, batch_size=1, limit=limit, log_samples=True, bootstrap_iters=0)
    except Exception as e:  # lm_eval's own errors have no common type: one line naming it
        raise UserError(f"lm_eval failed on {folder}: {type(e).__name__}: {e}") from None
    scores = {(task, int(sample["doc_id"])): float(sample["acc"])
              for task, samples in results["samples"].items() for sample in samples if "acc" in sample}
    if not scores:
        raise UserError(f"lm_eval wrote no per-question 'acc' for --tasks {tasks}: give multiple-choice tasks")
    return scores
