"""Synthetic memory tasks, generated here (no download), scored per task, against context length.

    python scripts/eval_tasks.py --checkpoint <dump>/checkpoint/step-N --config train_configs.mela:mela_debug \\
        [--checkpoint ... --config ... --mode ...] --tasks kv_retrieval,s_niah,mk_niah,fwe \\
        --context-lengths 1024,2048 --samples 20 --out <dir>

Tasks (each sample: a context of about the asked length in tokens, a query, the answer):
- kv_retrieval: GradMem's associative retrieval (Kuratov et al., "GradMem: Learning to Write
  Context into Memory with Test-Time Gradient Descent", section 4): keys and values of 2
  symbols from 62 (letters and digits), unique keys, context `!k1:v1!!k2:v2!...|`, query
  `?!k:`, answer `v`; as many pairs as fit. Scored by exact match of the value.
- s_niah: RULER single needle (Cho et al., "MoNe: Modular Neural Memory for Efficient Long
  Context Inference", appendix A.1): one "The special magic value for <adjective-noun>
  is: <adjective-noun>." at a random depth of filler text; substring match.
- mk_niah: RULER multi-key needle: four such needles at scattered depths, one queried, the
  other three are distractors; substring match.
- fwe: RULER frequent-word extraction: 6-letter words drawn from a Zipf law (alpha 2), the
  top-ranked word replaced by a noise token; answer the 3 most frequent others; recall.

The model answers by greedy decoding (`--answer-tokens`), reading the context in the chosen
mode (full, or streaming for memory models; see eval_long_ppl.py). Writes results.json,
results.md and tasks_vs_context.png (one panel per task, one line per model) to --out,
staged and moved into place at the end; bad input: one line, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch


from eval_long_ppl import entry_logits, load_entry, per_checkpoint

from torchtitan_ext.errors import UserError
from torchtitan_ext.paths import staged_folder

SYMBOLS = string.ascii_letters + string.digits  # GradMem's 62-symbol alphabet
ADJECTIVES = ["amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lucid",
              "mellow", "noble", "odd", "pale", "quiet", "rapid", "silent", "tidy", "upper", "vivid", "warm", "young"]
NOUNS = ["anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket", "kettle",
         "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tunnel", "violin", "walnut"]
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
NOISE_WORD = "zzzzzz"
TASKS = ("kv_retrieval", "s_niah", "mk_niah", "fwe")


@dataclass
class Sample:
    context: str
    query: str
    answers: list[str]  # kv / niah: one; fwe: the three words


def _compound(rng: random.Random, taken: set) -> str:
    while (word := f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}") in taken:
        pass
    taken.add(word)
    return word


def kv_retrieval(rng: random.Random, chars: int) -> Sample:
    """About `chars` characters of `!k:v!` pairs (one character is about one token here)."""
    n_pairs = max(2, (chars - 8) // 6)
    keys = rng.sample([a + b for a in SYMBOLS for b in SYMBOLS], n_pairs)
    values = ["".join(rng.choices(SYMBOLS, k=2)) for _ in keys]
    j = rng.randrange(n_pairs)
    context = "".join(f"!{k}:{v}!" for k, v in zip(keys, values)) + "|"
    return Sample(context, f"?!{keys[j]}:", [values[j]])


def _haystack(rng: random.Random, chars: int, needles: list[str]) -> str:
    sentences = FILLER.split(". ")
    text = []
    while sum(map(len, text)) < chars:
        text.append(rng.choice(sentences).strip(". ") + ". ")
    for needle in needles:
        text.insert(rng.randrange(len(text) + 1), needle + " ")
    return "".join(text)


def niah(rng: random.Random, chars: int, n_needles: int) -> Sample:
    taken: set = set()
    pairs = [(_compound(rng, taken), _compound(rng, taken)) for _ in range(n_needles)]
    needles = [f"The special magic value for {k} is: {v}." for k, v in pairs]
    key, value = rng.choice(pairs)
    return Sample(_haystack(rng, chars, needles), f" What is the special magic value for {key}? "
                  f"The special magic value for {key} is:", [value])


def fwe(rng: random.Random, chars: int) -> Sample:
    vocabulary = ["".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(200)]
    weights = [1 / (rank + 1) ** 2.0 for rank in range(len(vocabulary))]
    words = rng.choices(vocabulary, weights=weights, k=max(10, chars // 7))
    words = [NOISE_WORD if w == vocabulary[0] else w for w in words]
    top = [w for w, _ in Counter(w for w in words if w != NOISE_WORD).most_common(3)]
    return Sample(" ".join(words), " Question: what are the three most frequent words above? Answer:", top)


def generate(task: str, rng: random.Random, chars: int) -> Sample:
    if task == "kv_retrieval":
        return kv_retrieval(rng, chars)
    if task == "fwe":
        return fwe(rng, chars)
    return niah(rng, chars, 1 if task == "s_niah" else 4)


def score(task: str, output: str, answers: list[str]) -> float:
    """kv_retrieval: exact match of the value (the output's first 2 non-space symbols);
    niah: the answer is a substring of the output; fwe: recall of the 3 words."""
    if task == "kv_retrieval":
        return float(output.strip()[:2] == answers[0])
    if task == "fwe":
        return sum(a in output for a in answers) / len(answers)
    return float(answers[0] in output)


def fit_sample(task: str, rng: random.Random, tokenizer, length: int):
    """(token ids: BOS, context, query; sample) of the longest sample of at most `length`
    tokens, its size in characters found by bisection (same random draws each try)."""
    state, best, low, high = rng.getstate(), None, 8, 4 * length
    for _ in range(12):
        chars = (low + high) // 2
        rng.setstate(state)
        sample = generate(task, rng, chars)
        ids = tokenizer.encode(sample.context + sample.query, add_bos=True, add_eos=False)
        if len(ids) <= length:
            best, low = (ids, sample), chars
        else:
            high = chars
    if best is None:
        raise UserError(f"context length {length} is too short for a {task} sample")
    return best


def answer(entry, ids: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation of ids, each step reading the whole sequence in the entry's mode."""
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(new_tokens):
            seq = torch.cat([seq, entry_logits(entry, seq)[:, -1:].argmax(-1)], 1)
    return seq[0, len(ids):].tolist()


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from torchtitan_ext.tokenizer import AssetsTokenizer

    tasks = args.tasks.split(",")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise UserError(f"unknown task(s) {unknown}: choose from {list(TASKS)}")
    count = len(args.checkpoint)
    configs = per_checkpoint(args.config, count, "--config")
    modes = per_checkpoint(args.mode, count, "--mode", "full")
    labels = per_checkpoint(args.label, count, "--label")
    lengths = sorted(int(n) for n in args.context_lengths.split(","))
    loaded = [load_entry(c, cfg, m, lab, None, None) for c, cfg, m, lab in zip(args.checkpoint, configs, modes, labels)]
    if len({folder for _, folder in loaded}) > 1:
        raise UserError("the checkpoints use different tokenizers: evaluate them separately")
    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=loaded[0][1])
    runs = []
    for entry, _ in loaded:
        for length in lengths:
            if length + args.answer_tokens > entry.max_seq_len and entry.mode == "full":
                raise UserError(f"{entry.label} takes at most {entry.max_seq_len} tokens in one pass: use shorter "
                                "--context-lengths or --mode streaming")
        scores = {}
        for task in tasks:
            for length in lengths:
                rng = random.Random(f"{args.seed}-{task}-{length}")
                results = []
                for _ in tqdm(range(args.samples), desc=f"{entry.label} {task} @ {length}", file=sys.stderr):
                    ids, sample = fit_sample(task, rng, tokenizer, length)
                    output = tokenizer.decode(answer(entry, ids, args.answer_tokens))
                    results.append(score(task, output, sample.answers))
                scores.setdefault(task, {})[str(length)] = sum(results) / len(results)
        runs.append({"label": entry.label, "mode": entry.mode, "scores": scores})
    return {"tasks": tasks, "context_lengths": lengths, "samples": args.samples, "runs": runs}


def markdown(results: dict) -> str:
    lengths = results["context_lengths"]
    lines = [f"Synthetic memory tasks, {results['samples']} samples per cell (kv_retrieval: exact match; niah: "
             "substring match; fwe: recall of the top-3 words).", "",
             "| model | mode | task | " + " | ".join(map(str, lengths)) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in lengths) + " |"]
    for run in results["runs"]:
        for task, by_length in run["scores"].items():
            lines.append(f"| {run['label']} | {run['mode']} | {task} | "
                         + " | ".join(f"{by_length[str(n)]:.2f}" for n in lengths) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    tasks, lengths = results["tasks"], results["context_lengths"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for run in results["runs"]:
            ax.plot(lengths, [run["scores"][task][str(n)] for n in lengths], marker="o", label=f"{run['label']} ({run['mode']})")
        ax.set(title=task, xscale="log", xlabel="context length (tokens)", ylabel="score", ylim=(-0.05, 1.05))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(lengths, [str(n) for n in lengths])
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", action="append", required=True)
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--mode", action="append", choices=("full", "streaming"))
    parser.add_argument("--label", action="append")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--context-lengths", default="1024,2048,4096")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--answer-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        results = run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    with staged_folder(args.out) as staging:
        (staging / "results.json").write_text(json.dumps(results, indent=2))
        (staging / "results.md").write_text(markdown(results))
        plot(results, staging / "tasks_vs_context.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
