"""Synthetic memory tasks, generated here (no download), scored per task, against context length.

    python scripts/eval_tasks.py --checkpoint <dump>/checkpoint/step-N --config train_configs.mela:mela_debug \\
        [--checkpoint ... --config ... --mode ...] --tasks kv_retrieval,s_niah,mk_niah,fwe \\
        --context-lengths 1024,2048 --samples 20 --out <dir>

Tasks (each sample: a context of about the asked length in tokens, a query, the answer):
kv_retrieval, s_niah, mk_niah, fwe (`torchtitan_ext/synthetic_tasks.py`, which also feeds
finetuning: `torchtitan_ext/task_data.py`).

The model answers by greedy decoding (`--answer-tokens`), reading the context in the chosen
mode (full, or streaming for memory models; see eval_long_ppl.py). Beside the score, the
answer's perplexity: exp of the mean NLL of the answer and EOS tokens (the tokens a task
finetune is trained on, torchtitan_ext/task_data.py) given the prompt, with a 95% bootstrap
interval over samples; small models that never answer right still differ there. Writes
results.json, results.md and tasks_vs_context.png (one panel per task, one line per model)
to --out, staged and moved into place at the end; bad input: one line, exit code 2.

`--mode gradmem` (GradMem checkpoints, train_configs.gradmem): KV-retrieval with the context
removed, as the paper's Table 1: each context of `--pairs` key-value pairs is written into the
memory with K gradient steps for each K of `--write-steps` (a forward-WRITE checkpoint at its
own K), the value answered from [memory; query] alone; exact match per number of pairs with a
95% Wilson interval, GradMem and the forward-only baseline rows in one table
(gradmem.md / gradmem.json / gradmem.png).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from eval_long_ppl import bootstrap, entry_logits, load_entry, per_checkpoint

from torchtitan_ext.errors import UserError
from torchtitan_ext.paths import staged_folder
from torchtitan_ext.synthetic_tasks import fit_sample, score, TASKS
from torchtitan_ext.task_data import MAX_ANSWER_TOKENS, with_answer

def answer(entry, ids: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation of ids. Streaming a model that continues from any token (stream
    segment 1: the backbones and their grafts) reads the prompt once and then one token per
    step, its state carried; otherwise each step re-reads the whole sequence in the entry's
    mode (a Mela stream continues at chunk boundaries only)."""
    if entry.mode == "streaming" and entry.model.cfg.stream_segment == 1:
        return streamed_answer(entry, ids, new_tokens)
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(new_tokens):
            seq = torch.cat([seq, entry_logits(entry, seq)[:, -1:].argmax(-1)], 1)
    return seq[0, len(ids):].tolist()


def streamed_answer(entry, ids: list[int], new_tokens: int) -> list[int]:
    """`answer` by the stream: the prompt in the entry's segments, then token by token."""
    prompt, state, generated = torch.tensor([ids]), None, []
    with torch.no_grad():
        for start in range(0, prompt.shape[1], entry.segment):
            logits, state = entry.model.stream(prompt[:, start:start + entry.segment], state)
        while True:
            generated.append(logits[:, -1:].argmax(-1))
            if len(generated) == new_tokens:
                return torch.cat(generated, 1)[0].tolist()
            logits, state = entry.model.stream(generated[-1], state)


def answer_nll(entry, full: list[int], start: int) -> float:
    """Mean NLL of full[start:] (the answer and EOS) given the tokens before each."""
    tokens = torch.tensor([full])
    with torch.no_grad():
        logits = entry_logits(entry, tokens[:, :-1])
    return F.cross_entropy(logits[0, start - 1:].float(), tokens[0, start:]).item()


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
            if length + max(args.answer_tokens, MAX_ANSWER_TOKENS) > entry.max_seq_len and entry.mode == "full":
                raise UserError(f"{entry.label} takes at most {entry.max_seq_len} tokens in one pass: use shorter "
                                "--context-lengths or --mode streaming")
        scores, answer_ppl = {}, {}
        for task in tasks:
            for length in lengths:
                rng = random.Random(f"{args.seed}-{task}-{length}")
                results, nlls = [], []
                for _ in tqdm(range(args.samples), desc=f"{entry.label} {task} @ {length}", file=sys.stderr):
                    ids, sample = fit_sample(task, rng, tokenizer, length)
                    output = tokenizer.decode(answer(entry, ids, args.answer_tokens))
                    results.append(score(task, output, sample.answers))
                    nlls.append(answer_nll(entry, *with_answer(task, sample, ids, tokenizer)))
                scores.setdefault(task, {})[str(length)] = sum(results) / len(results)
                mean = torch.tensor(nlls, dtype=torch.float64)
                answer_ppl.setdefault(task, {})[str(length)] = [mean.mean().exp().item(), *bootstrap(mean)]
        runs.append({"label": entry.label, "mode": entry.mode, "scores": scores, "answer_ppl": answer_ppl})
    return {"tasks": tasks, "context_lengths": lengths, "samples": args.samples, "runs": runs}


def run_gradmem(args: argparse.Namespace) -> dict:
    """Exact match from the written memory per (checkpoint, K) and number of pairs."""
    from models.lms.gradmem import GradMemLM
    from torchtitan_ext.gradmem import kv_cell
    from torchtitan_ext.tokenizer import AssetsTokenizer

    count = len(args.checkpoint)
    if any(m != "gradmem" for m in per_checkpoint(args.mode, count, "--mode", "gradmem")):
        raise UserError("--mode gradmem evaluates GradMem checkpoints only: give it to every --checkpoint")
    pairs = [int(n) for n in args.pairs.split(",")]
    steps = [int(k) for k in args.write_steps.split(",")]
    if min(pairs) < 1 or min(steps) < 1:
        raise UserError("--pairs and --write-steps take counts of at least 1 (K = 0 writes nothing)")
    configs, labels = per_checkpoint(args.config, count, "--config"), per_checkpoint(args.label, count, "--label")
    rows = []
    for checkpoint, config, label in zip(args.checkpoint, configs, labels):
        entry, folder = load_entry(checkpoint, config, "full", label, None, None)
        model = entry.model
        if not isinstance(model, GradMemLM):
            raise UserError(f"{entry.label} is not a GradMem model: --mode gradmem needs a train_configs.gradmem config")
        tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=folder)
        write = model.gradmem.cfg.write
        for k in (steps if write == "gradient" else [model.gradmem.cfg.write_steps]):
            cells = [kv_cell(model, tokenizer, n, k, args.samples, args.seed) for n in pairs]
            rows.append({"label": entry.label, "write": write, "k": k, "cells": cells})
    return {"pairs": pairs, "samples": args.samples, "rows": rows}


def gradmem_markdown(results: dict) -> str:
    pairs = results["pairs"]
    lines = [f"KV-retrieval exact match (%) from the memory alone, {results['samples']} samples per cell "
             "(95% Wilson interval).", "", "| model | WRITE | K | " + " | ".join(map(str, pairs)) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in pairs) + " |"]
    for row in results["rows"]:
        cells = [f"{100 * c['em']:.1f} ({100 * c['ci'][0]:.1f}-{100 * c['ci'][1]:.1f})" for c in row["cells"]]
        lines.append(f"| {row['label']} | {row['write']} | {row['k']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def gradmem_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for row in results["rows"]:
        em = [100 * c["em"] for c in row["cells"]]
        spread = [[max(0.0, e - 100 * c["ci"][0]) for e, c in zip(em, row["cells"])],
                  [max(0.0, 100 * c["ci"][1] - e) for e, c in zip(em, row["cells"])]]
        ax.errorbar(results["pairs"], em, yerr=spread, marker="o", capsize=3,
                    label=f"{row['label']} ({row['write']}, K={row['k']})")
    ax.set(xscale="log", xlabel="key-value pairs", ylabel="exact match (%)", ylim=(-3, 103))
    ax.minorticks_off()
    ax.set_xticks(results["pairs"], [str(n) for n in results["pairs"]])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    lines += ["", "Answer perplexity (answer and EOS tokens given the prompt; 95% bootstrap interval over samples):",
              "", "| model | mode | task | " + " | ".join(map(str, lengths)) + " |",
              "| --- | --- | --- | " + " | ".join("---" for _ in lengths) + " |"]
    for run in results["runs"]:
        for task, by_length in run["answer_ppl"].items():
            cells = (by_length[str(n)] for n in lengths)
            lines.append(f"| {run['label']} | {run['mode']} | {task} | "
                         + " | ".join(f"{ppl:.2f} ({low:.2f}-{high:.2f})" for ppl, low, high in cells) + " |")
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
    parser.add_argument("--mode", action="append", choices=("full", "streaming", "gradmem"))
    parser.add_argument("--pairs", default="4,8,16,32,64,96", help="gradmem mode: key-value pairs per context")
    parser.add_argument("--write-steps", default="1,2,5", help="gradmem mode: K at evaluation (gradient WRITE)")
    parser.add_argument("--label", action="append")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--context-lengths", default="1024,2048,4096")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--answer-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.mode and "gradmem" in args.mode:
            results = run_gradmem(args)
            with staged_folder(args.out) as staging:
                (staging / "gradmem.json").write_text(json.dumps(results, indent=2))
                (staging / "gradmem.md").write_text(gradmem_markdown(results))
                gradmem_plot(results, staging / "gradmem.png")
            print(gradmem_markdown(results))
            return
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
