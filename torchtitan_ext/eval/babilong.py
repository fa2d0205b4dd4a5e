"""BABILong (Kuratov et al., 2024) as the MemoryLlama thesis evaluates it (thesis section 4.2.3,
Table 5.1): the official files when given, an offline generator of qa1-qa5 otherwise, the
prompt format, the tables. `scripts/eval_tasks.py --tasks babilong` runs the models.

Protocol (thesis section 4.2.3, appendix B.1): 100 samples per task and length, one sample
at a time with the memory reset (every sample is a new stream / a new forward pass), greedy
decoding of 25 tokens, correct when the target (one word) is a substring of the output;
accuracy in %.

Prompt (the choice where the thesis is silent): the BABILong reference template
(booydar/babilong `babilong/prompts.py`, DEFAULT_TEMPLATE) without the optional task
instruction, in-context examples and post-prompt (the thesis prints no prompt; these are
base models), ended by "Answer:" as in the reference examples, so a base model continues with the answer:

    <context>\\n{input}\\n</context>\\nQuestion: {question}\\nAnswer:

split as `Sample(context="<context>\\n{input}\\n</context>\\n", query="Question: {question}\\nAnswer:")`
so that a model whose question phase starts a new segment (MoNe) sees the question alone.

Official files (`read_official`): a folder holding each asked (task, length) once, as the
Hugging Face datasets store them: RMT-team/babilong (`qa1/2k-00000-of-00001.parquet`),
RMT-team/babilong-1k-samples (`2k/qa1-00000-of-00001.parquet`), their parquet-converter
branch (`2k/qa1/0000.parquet`), `DatasetDict.save_to_disk` per length (`2k/qa1/*.arrow`), or
.json / .jsonl files named the same way; rows with fields `input`, `question`, `target`, the
first `samples` of each split read in order.

Generator (`story`, `hide`): bAbI-style stories (Weston et al., 2015) of tasks qa1-qa5,
answers known by construction from the simulated world, the facts kept in order and
scattered between consecutive sentences of held-out real text (the validation split of the
embedded corpus, `torchtitan_ext/data/datasets.py`: 505 sentences kept, 11.3K tokens with the
default tokenizer, read cyclically past their end), as many sentences as keep the prompt within the asked
length in tokens; length 0 ("0k") is the story alone, as BABILong's 0k. Haystack sentences
naming a person, place or object of the stories are dropped, so the text never contradicts
a fact. Facts per story (fewer than BABILong's largest, so that stories fit CPU lengths):
qa1 2-10, qa2 4-12, qa3 6-14, qa4 2, qa5 4-12 events (0k prompts of about 70-220 tokens
with the default tokenizer).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from torchtitan_ext.errors import UserError
from torchtitan_ext.eval.stats import format_summary, summarize_seeds
from torchtitan_ext.data.synthetic_tasks import Sample

TASKS = tuple(f"qa{i}" for i in range(1, 11))  # the official files; the thesis reports all ten
GENERATED_TASKS = TASKS[:5]
SAMPLES = 100  # per task and length (thesis appendix B.1, num_test_samples)
ANSWER_TOKENS = 25  # greedy tokens (thesis appendix B.1, max_gen_tokens)
FIELDS = ("input", "question", "target")
SAVE_TO_DISK_METADATA = ("dataset_dict.json", "dataset_info.json", "state.json")
FILE_SUFFIXES = (".parquet", ".json", ".jsonl", ".arrow")

PEOPLE = ("Mary", "John", "Daniel", "Sandra")
LOCATIONS = ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office")
OBJECTS = ("apple", "football", "milk")
MOVE = ("moved to", "went to", "journeyed to", "travelled to", "went back to")
TAKE = ("picked up", "got", "grabbed", "took")
DROP = ("dropped", "discarded", "put down", "left")
GIVE = ("gave", "handed", "passed")
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}
EVENTS = {"qa1": (2, 10), "qa2": (4, 12), "qa3": (6, 14), "qa5": (4, 12)}


CONTEXT, QUERY = "<context>\n{}\n</context>\n", "Question: {}\nAnswer:"  # the prompt (module docstring)


def sample(context: str, question: str, target: str) -> Sample:
    """The prompt of one BABILong item (module docstring), its target as the one answer."""
    return Sample(CONTEXT.format(context.strip()), QUERY.format(question.strip()), [target])


def correct(output: str, target: str) -> bool:
    """The thesis' criterion: the target is present in the generated text."""
    return target in output


def length_tokens(name: str) -> int:
    """Tokens of a length: "2k" -> 2048 (BABILong's names), "2048" -> 2048; UserError otherwise."""
    match = re.fullmatch(r"(\d+)([kK]?)", name.strip())
    if not match:
        raise UserError(f"context length '{name}' is not a number of tokens or a BABILong name such as 2k: "
                        "pass e.g. --context-lengths 0k,1k,2k")
    return int(match[1]) * (1024 if match[2] else 1)


def length_name(name: str) -> str:
    """BABILong's name of a length: "2048" or "2k" -> "2k"; UserError when it has none."""
    tokens = length_tokens(name)
    if tokens % 1024:
        raise UserError(f"BABILong's files come in lengths 0k, 1k, 2k, 4k, ... (multiples of 1024 tokens), not "
                        f"{name}: pass --context-lengths such as 1k,2k")
    return f"{tokens // 1024}k"


def _rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix == ".arrow":
        from datasets import Dataset

        return Dataset.from_file(str(path)).to_list()
    text = path.read_text()  # a JSON list of rows, or JSON lines
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _names(path: Path, root: Path) -> set[str]:
    """The task / length names a data file's path below root spells: every folder and the
    file's stem, each cut at its first '-' (`qa1-00000-of-00001` -> qa1)."""
    parts = path.relative_to(root).with_suffix("").parts
    return {part.split("-")[0] for part in parts}


def read_official(root: str | Path, tasks: list[str], lengths: list[str], samples: int) -> dict:
    """{(task, length name): [Sample]} of the first `samples` rows of each split under root
    (module docstring). A missing folder, (task, length) or field: UserError naming it."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"BABILong folder '{root}' does not exist: download RMT-team/babilong (huggingface-cli "
                        f"download RMT-team/babilong --repo-type dataset --local-dir {root}) or drop --babilong-path "
                        "for the offline generator")
    files = [p for p in sorted(root.rglob("*")) if p.suffix in FILE_SUFFIXES and p.name not in SAVE_TO_DISK_METADATA]
    found = {}
    for task in tasks:
        for length in lengths:
            found[task, length] = [p for p in files if {task, length} <= _names(p, root)]
    missing = [f"{task} at {length}" for (task, length), paths in found.items() if not paths]
    if missing:
        raise UserError(f"BABILong folder '{root}' has no {', '.join(missing)}: download those splits into it, "
                        "or choose others with --babilong-tasks / --context-lengths")
    out = {}
    for (task, length), paths in found.items():
        rows = [row for path in paths for row in _rows(path)][:samples]
        absent = [f for f in FIELDS if rows and f not in rows[0]]
        if not rows or absent:
            raise UserError(f"BABILong {task} at {length} in '{root}' ({paths[0].name}) has "
                            f"{'no rows' if not rows else 'no field ' + ', '.join(absent)}: its rows need fields "
                            f"{', '.join(FIELDS)}")
        out[task, length] = [sample(r["input"], r["question"], r["target"]) for r in rows]
    return out


@dataclass
class Story:
    """A bAbI-style story: its facts in order, the question and its one-word answer."""

    facts: list[str]
    question: str
    answer: str


def _qa1(rng: random.Random) -> Story | None:
    """Single supporting fact: people move; where is one of them now?"""
    facts, where = [], {}
    for _ in range(rng.randint(*EVENTS["qa1"])):
        person = rng.choice(PEOPLE)
        where[person] = rng.choice([loc for loc in LOCATIONS if loc != where.get(person)])
        facts.append(f"{person} {rng.choice(MOVE)} the {where[person]}.")
    person = rng.choice(sorted(where))
    return Story(facts, f"Where is {person}?", where[person])


class _World:
    """People moving, taking, dropping and giving objects (bAbI's world, simplified): an object
    is taken where it lies (or anywhere before it was first seen) by someone whose place is
    known, given only to someone in the same place; `trail` is each object's places in order."""

    def __init__(self, rng: random.Random, gives: bool):
        self.rng, self.gives = rng, gives
        self.where, self.holder, self.lies, self.trail = {}, {}, {}, {}
        self.facts, self.given = [], []  # given: (giver, object, receiver)

    def place(self, obj: str) -> str | None:
        return self.where[self.holder[obj]] if obj in self.holder else self.lies.get(obj)

    def _moved(self, obj: str) -> None:
        if not self.trail.get(obj) or self.trail[obj][-1] != self.place(obj):
            self.trail.setdefault(obj, []).append(self.place(obj))

    def actions(self) -> list:
        rng, acts = self.rng, []
        person = rng.choice(PEOPLE)
        acts += [("move", person)] * 3
        if person in self.where:
            here = self.where[person]
            free = [o for o in OBJECTS if o not in self.holder and self.lies.get(o, here) == here]
            acts += [("take", person, o) for o in free]
            held = [o for o, p in self.holder.items() if p == person]
            acts += [("drop", person, o) for o in held]
            mates = [p for p in PEOPLE if p != person and self.where.get(p) == self.where[person]]
            if self.gives:
                acts += [("give", person, o, m) for o in held for m in mates] * 4
        return acts

    def step(self) -> None:
        kind, person, *rest = self.rng.choice(self.actions())
        rng = self.rng
        if kind == "move":
            self.where[person] = rng.choice([loc for loc in LOCATIONS if loc != self.where.get(person)])
            self.facts.append(f"{person} {rng.choice(MOVE)} the {self.where[person]}.")
        elif kind == "take":
            self.holder[rest[0]] = person
            self.facts.append(f"{person} {rng.choice(TAKE)} the {rest[0]} there.")
        elif kind == "drop":
            self.lies[rest[0]] = self.where[person]
            del self.holder[rest[0]]
            self.facts.append(f"{person} {rng.choice(DROP)} the {rest[0]}.")
        else:
            obj, mate = rest
            self.holder[obj] = mate
            self.given.append((person, obj, mate))
            self.facts.append(f"{person} {rng.choice(GIVE)} the {obj} to {mate}.")
        for obj in OBJECTS:
            if self.place(obj) is not None:
                self._moved(obj)


def _world(rng: random.Random, task: str, gives: bool = False) -> _World:
    world = _World(rng, gives)
    for _ in range(rng.randint(*EVENTS[task])):
        world.step()
    return world


def _qa2(rng: random.Random) -> Story | None:
    """Two supporting facts: where is an object someone took (and perhaps carried, dropped)?"""
    world = _world(rng, "qa2")
    carried = [o for o in OBJECTS if o in world.trail]
    if not carried:
        return None
    obj = rng.choice(carried)
    return Story(world.facts, f"Where is the {obj}?", world.place(obj))


def _qa3(rng: random.Random) -> Story | None:
    """Three supporting facts: where was an object before a place it was carried to (a place
    on its trail once only, so "before" names one place)?"""
    world = _world(rng, "qa3")
    asks = [(o, i) for o, trail in world.trail.items() for i in range(1, len(trail)) if trail.count(trail[i]) == 1]
    if not asks:
        return None
    obj, i = rng.choice(asks)
    return Story(world.facts, f"Where was the {obj} before the {world.trail[obj][i]}?", world.trail[obj][i - 1])


def _qa4(rng: random.Random) -> Story:
    """Two-argument relations: two places on two different sides of a third, each fact said
    either way round; asked "What is D of the Y?" or "What is the X D of?" (one answer either
    way, since the two sides differ)."""
    middle, first, second = rng.sample(LOCATIONS, 3)
    side_a = rng.choice(sorted(OPPOSITE))
    side_b = rng.choice([d for d in sorted(OPPOSITE) if d != side_a])
    relations, facts = [], []
    for place, side in ((first, side_a), (second, side_b)):
        stated = (place, side, middle) if rng.random() < 0.5 else (middle, OPPOSITE[side], place)
        relations.append(stated)
        facts.append(f"The {stated[0]} is {stated[1]} of the {stated[2]}.")
    x, side, y = rng.choice(relations)
    if rng.random() < 0.5:
        return Story(facts, f"What is {side} of the {y}?", x)
    return Story(facts, f"What is the {x} {side} of?", y)


def _qa5(rng: random.Random) -> Story | None:
    """Three-argument relations: people give objects to one another; a question about one
    gift whose answer no other gift of the story contradicts."""
    world = _world(rng, "qa5", gives=True)
    questions = {}
    for giver, obj, receiver in world.given:
        for question, answer in ((f"Who gave the {obj}?", giver), (f"Who received the {obj}?", receiver),
                                 (f"Who did {giver} give the {obj} to?", receiver),
                                 (f"Who gave the {obj} to {receiver}?", giver),
                                 (f"What did {giver} give to {receiver}?", obj)):
            questions.setdefault(question, set()).add(answer)
    unique = sorted(q for q, answers in questions.items() if len(answers) == 1)
    if not unique:
        return None
    question = rng.choice(unique)
    return Story(world.facts, question, questions[question].pop())


STORIES = {"qa1": _qa1, "qa2": _qa2, "qa3": _qa3, "qa4": _qa4, "qa5": _qa5}


def story(task: str, rng: random.Random) -> Story:
    """A story of task qa1-qa5 drawn from rng (redrawn until it can ask a question)."""
    if task not in STORIES:
        raise UserError(f"the BABILong generator makes {', '.join(STORIES)}, not {task}: pass --babilong-path "
                        "<official files> for qa6-qa10, or --babilong-tasks among those")
    while (drawn := STORIES[task](rng)) is None:
        pass
    return drawn


@lru_cache(maxsize=1)
def haystack() -> tuple[str, ...]:
    """Sentences of the embedded corpus' held-out split, whitespace collapsed, 4-80 words,
    none naming a person, place or object of the stories (module docstring)."""
    from torchtitan_ext.data.datasets import HELDOUT_PER_MILLE, is_heldout
    from torchtitan_ext.data.embedded_corpus import embedded_documents

    banned = re.compile(r"\b(" + "|".join(PEOPLE + LOCATIONS + OBJECTS) + r")\b", re.IGNORECASE)
    sentences = []
    for doc in (d for d in embedded_documents() if is_heldout(d, HELDOUT_PER_MILLE["embedded"])):
        for text in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
            if 4 <= len(text.split()) <= 80 and not banned.search(text):
                sentences.append(text)
    return tuple(sentences)


def hide(drawn: Story, rng: random.Random, tokenizer, length: int) -> tuple[list[int], Sample]:
    """(prompt ids: BOS + context + query, Sample) of a story scattered through consecutive
    haystack sentences from a random start: the most sentences (and so the longest context)
    whose prompt stays within `length` tokens; length 0: the story alone."""
    sentences = haystack()
    start = rng.randrange(len(sentences))
    slots = sorted(rng.random() for _ in drawn.facts)  # each fact's depth in the text, kept in order

    def build(count: int) -> tuple[list[int], Sample]:
        text = [sentences[(start + i) % len(sentences)] for i in range(count)]
        for depth, fact in sorted(zip(slots, drawn.facts), key=lambda pair: -pair[0]):
            text.insert(round(depth * count), fact)
        item = sample(" ".join(text), drawn.question, drawn.answer)
        return tokenizer.encode(item.context + item.query, add_bos=True, add_eos=False), item

    fits = build(0)
    if len(fits[0]) > length > 0:
        raise UserError(f"context length {length} is too short for this {len(fits[0])}-token story: pass longer "
                        "--context-lengths")
    low, high = 0, 1  # build(low) fits; find a count that does not, then bisect
    while length and len((grown := build(high))[0]) <= length:
        low, high, fits = high, 2 * high, grown
    while length and high - low > 1:
        middle = (low + high) // 2
        if len((grown := build(middle))[0]) <= length:
            low, fits = middle, grown
        else:
            high = middle
    return fits


def items(tasks: list[str], lengths: list[str], samples: int, seed: int, tokenizer,
          official: dict | None = None) -> dict:
    """{(task, length): [(prompt ids, Sample)]}: the official samples (`read_official`'s) when
    given, else `samples` generated ones of at most `length` tokens each, drawn from
    random.Random(f"{seed}-{task}-{length}")."""
    if official:
        return {cell: [(tokenizer.encode(s.context + s.query, add_bos=True, add_eos=False), s) for s in rows]
                for cell, rows in official.items()}
    cells = {}
    for task in tasks:
        for length in lengths:
            rng = random.Random(f"{seed}-{task}-{length}")
            tokens = length_tokens(length)
            cells[task, length] = [hide(story(task, rng), rng, tokenizer, tokens) for _ in range(samples)]
    return cells


def encode(item: Sample, ids: list[int], tokenizer, question: str) -> tuple[list[int], int]:
    """(prompt ids, the question's first index) of an item whose BOS + context + query encodes
    jointly as `ids`, the question placed as `scripts/eval_tasks.py --question` says:
    "continue" reads it right after the context (index 0: no new segment), "new_segment"
    (MoNe's query phase) encodes BOS + context and the query apart."""
    if question == "continue":
        return ids, 0
    context = tokenizer.encode(item.context, add_bos=True, add_eos=False)
    return context + tokenizer.encode(item.query, add_bos=False, add_eos=False), len(context)


def evaluate(generate, cells: dict, tokenizer, question: str = "continue", label: str = "") -> dict:
    """{task: {length: {"correct": [0/1], "outputs": [text]}}} of one checkpoint:
    `generate(ids, query)` -> the greedy continuation's ids of a prompt whose question starts
    a new segment at `query` (0: none), a fresh state per call (the memory reset per sample)."""
    import sys

    from tqdm import tqdm

    out: dict = {}
    for (task, length), rows in cells.items():
        outputs = [tokenizer.decode(generate(*encode(item, ids, tokenizer, question)))
                   for ids, item in tqdm(rows, desc=f"{label} {task} @ {length}", file=sys.stderr)]
        out.setdefault(task, {})[length] = {
            "correct": [int(correct(text, item.answers[0])) for text, (_, item) in zip(outputs, rows)],
            "outputs": outputs}
    return out


def summarize(label: str, mode: str, question: str, checkpoints: list[str], per_seed: list[dict]) -> dict:
    """One model's accuracy per task and length over its seeds (checkpoints): the pooled
    accuracy with the seeds-then-items 95% interval and each seed's (stats.summarize_seeds)."""
    accuracy = {task: {length: summarize_seeds([seed[task][length]["correct"] for seed in per_seed])
                       for length in by_length} for task, by_length in per_seed[0].items()}
    return {"label": label, "mode": mode, "question": question, "accuracy": accuracy,
            "seeds": [{"checkpoint": c, "cells": cells} for c, cells in zip(checkpoints, per_seed)]}


def markdown(results: dict) -> str:
    """The thesis' table (Table 5.1: accuracy %, one row per task) with lengths as columns,
    one block of rows per model."""
    lengths = results["lengths"]
    lines = [f"BABILong accuracy (%), {results['samples']} samples per task and length ({results['source']}); greedy "
             f"{results['answer_tokens']} tokens, correct when the target is in the output, memory reset per sample "
             "(MemoryLlama thesis 4.2.3). 95% interval: seeds (checkpoints of one label), then samples.", "",
             "| model | mode | question | task | " + " | ".join(lengths) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in lengths) + " |"]
    for model in results["models"]:
        for task, by_length in model["accuracy"].items():
            lines.append(f"| {model['label']} | {model['mode']} | {model['question']} | {task} | "
                         + " | ".join(format_summary(by_length[n], scale=100, digits=0) for n in lengths) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Accuracy (%) against length, one panel per task, one line per model with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, tasks = results["lengths"], results["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3.2), squeeze=False, sharey=True)
    for ax, task in zip(axes[0], tasks):
        for model in results["models"]:
            cells = [model["accuracy"][task][n] for n in lengths]
            pooled = [100 * c["pooled"] for c in cells]
            spread = [[p - 100 * c["ci95"][0] for p, c in zip(pooled, cells)],
                      [100 * c["ci95"][1] - p for p, c in zip(pooled, cells)]]
            ax.errorbar(range(len(lengths)), pooled, yerr=spread, marker="o", capsize=3,
                        label=f"{model['label']} ({model['mode']}, {model['question']})")
        ax.set(title=task, xlabel="length", ylim=(-3, 103))
        ax.set_xticks(range(len(lengths)), lengths)
    axes[0][0].set_ylabel("accuracy (%)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
