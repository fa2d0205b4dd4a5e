"""Synthetic memory tasks, generated (no download), scored per task against context length
(`scripts/eval_tasks.py` runs them; its flags are named here), BABILong, and GradMem's
KV-retrieval from the memory alone.

Tasks (each sample: a context of about the asked length in tokens, a query, the answer):
kv_retrieval, s_niah, mk_niah, fwe (`torchtitan_ext/data/synthetic_tasks.py`, which also feeds
finetuning: `torchtitan_ext/data/task_data.py`).

The model answers by greedy decoding (`--answer-tokens`), reading the context in the chosen
mode (full, or streaming for memory models; see torchtitan_ext/eval/long_ppl.py). `--question` (one, or one
per checkpoint) places the question as the task rows of torchtitan_ext/data/task_data.py do:
"new_segment" (the default for a model whose every block is MoNe: paper 004's query phase)
writes the whole context into the memory, its last short segment too, and reads the question
as a new segment at positions [0, Q), attending to the memory tokens and itself only (one
pass: [context | question] as two documents; streaming: the context's stream, its segments
ended (models/grafts/mone.py `end_segments`), then the question); "continue" (every other
model's default and only choice) reads the question right after the context. `--haystack`:
the needle tasks' haystack (torchtitan_ext/data/synthetic_tasks.py; default the paper's: S-NIAH
noise, MK-NIAH held-out text). Beside the score, the answer's perplexity: exp of the mean NLL
of the answer and EOS tokens (the tokens a task finetune is trained on) given the prompt.
Checkpoints sharing a `--label` (by default their config's name), mode and question are one
model's seeds: each cell gives the pooled figure with a 95% interval that resamples seeds,
then samples (torchtitan_ext/eval/stats.py), and each seed's figure beside it (one checkpoint:
the interval over samples). The table and plot: one panel per task, one line per model.

`--tasks babilong` (alone): BABILong by the MemoryLlama thesis' protocol (section 4.2.3;
torchtitan_ext/eval/babilong.py): 100 samples per task and length (`--samples`), each a new
stream (memory reset), greedy 25 tokens (`--answer-tokens`), correct when the target is in
the output; the official files of `--babilong-path DIR` (qa1-qa10, lengths 0k, 1k, 2k, ...
as `--context-lengths`), or generated qa1-qa5 stories in held-out text of at most each
length in tokens; the question placed as `--question` says (the thesis reads it right after
the context; MoNe's default starts it as a new segment). Seeds as above: accuracy % per task
and length with a seeds-then-items 95% interval, each seed's beside it; babilong.md (the
thesis' table, lengths as columns), babilong.json (with every output), babilong.png.

`--mode gradmem` (GradMem checkpoints, train_configs.gradmem): KV-retrieval with the context
removed, as the paper's Table 1: each context of `--pairs` key-value pairs is written into the
memory with K gradient steps for each K of `--write-steps` (a forward-WRITE checkpoint at its
own K), the value answered from [memory; query] alone; exact match per number of pairs, seeds
(checkpoints sharing a label) pooled as above with each seed's figure beside, GradMem and the
forward-only baseline rows in one table (gradmem.md / gradmem.json / gradmem.png).

Bad input raises UserError. Shapes: tokens (B, L), logits (B, L, vocab); a prompt is a list of
token ids (BOS first).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from models.grafts.gradmem import GradMemLM
from models.grafts.mone import end_segments, MoNeBlock
from torchtitan_ext.errors import UserError
from torchtitan_ext.eval import babilong
from torchtitan_ext.eval.long_ppl import entry_logits, load_entry, per_checkpoint
from torchtitan_ext.eval.stats import format_summary, summarize_seeds
from torchtitan_ext.data.synthetic_tasks import fit_sample, score, TASKS
from torchtitan_ext.data.task_data import MAX_ANSWER_TOKENS, split_with_answer, with_answer


def segment_memory(model) -> bool:
    """Whether the model can start the question as a new segment: every block is MoNe."""
    layers = getattr(model, "layers", None)
    return isinstance(layers, torch.nn.ModuleDict) and all(isinstance(b, MoNeBlock) for b in layers.values())


def stream_chunks(entry, tokens: torch.Tensor, state):
    """Logits of tokens (B, L) streamed in the entry's segments after `state`, and the state."""
    logits = []
    for start in range(0, tokens.shape[1], entry.segment):
        out, state = entry.model.stream(tokens[:, start:start + entry.segment], state)
        logits.append(out)
    return torch.cat(logits, 1), state


def prompt_logits(entry, tokens: torch.Tensor, query: int = 0) -> torch.Tensor:
    """Logits (B, L, vocab) of tokens (B, L) whose question starts at `query` as a new segment
    (module docstring), or continues the context (query 0)."""
    if not query:
        return entry_logits(entry, tokens)
    if entry.mode == "streaming":
        context, state = stream_chunks(entry, tokens[:, :query], None)
        question, _ = stream_chunks(entry, tokens[:, query:], end_segments(entry.model.layers.values(), state))
        return torch.cat([context, question], 1)
    positions = torch.cat([torch.arange(query), torch.arange(tokens.shape[1] - query)]).expand_as(tokens)
    return entry.model(tokens, positions)


def answer(entry, ids: list[int], new_tokens: int, query: int = 0) -> list[int]:
    """Greedy continuation of ids (the question from `query` on as a new segment, or 0).
    Streaming a model that continues from any token (stream segment 1: the backbones and
    their grafts) reads the prompt once and then one token per step, its state carried;
    a GradMem model writes the context once and reads the question after the memory
    (`written_answer`); otherwise each step re-reads the whole sequence in the entry's mode
    (a Mela stream continues at chunk boundaries only)."""
    if isinstance(entry.model, GradMemLM):
        return written_answer(entry.model, ids, new_tokens, query)
    if entry.mode == "streaming" and entry.model.cfg.stream_segment == 1:
        return streamed_answer(entry, ids, new_tokens, query)
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(new_tokens):
            seq = torch.cat([seq, prompt_logits(entry, seq, query)[:, -1:].argmax(-1)], 1)
    return seq[0, len(ids):].tolist()


def written_answer(model: GradMemLM, ids: list[int], new_tokens: int, query: int) -> list[int]:
    """Greedy continuation of a GradMem prompt: ids[:query] (BOS + context) written into the
    memory, ids[query:] (the question) read after it at positions from 0 (GradMemLM.generate);
    UserError without a new-segment question (query 0: the read would have no context)."""
    if not 0 < query < len(ids):
        raise UserError("GradMem answers from the memory its context was written into: start the question as a "
                        "new segment after the context (0 < query < prompt length)")
    return model.generate(torch.tensor([ids[:query]]), torch.tensor([query]), torch.tensor([ids[query:]]),
                          new_tokens)[0].tolist()


def streamed_answer(entry, ids: list[int], new_tokens: int, query: int = 0) -> list[int]:
    """`answer` by the stream: the prompt in the entry's segments (the context's segments
    ended before a new-segment question), then token by token."""
    prompt, generated = torch.tensor([ids]), []
    with torch.no_grad():
        logits, state = stream_chunks(entry, prompt[:, :query or None], None)
        if query:
            logits, state = stream_chunks(entry, prompt[:, query:], end_segments(entry.model.layers.values(), state))
        while True:
            generated.append(logits[:, -1:].argmax(-1))
            if len(generated) == new_tokens:
                return torch.cat(generated, 1)[0].tolist()
            logits, state = entry.model.stream(generated[-1], state)


def answer_nll(entry, full: list[int], start: int, query: int = 0) -> float:
    """Mean NLL of full[start:] (the answer and EOS) given the tokens before each (the
    question from `query` on as a new segment, or 0)."""
    tokens = torch.tensor([full])
    with torch.no_grad():
        logits = prompt_logits(entry, tokens[:, :-1], query)
    return F.cross_entropy(logits[0, start - 1:].float(), tokens[0, start:]).item()


def encode_prompt(task: str, sample, ids: list[int], tokenizer, question: str):
    """(prompt ids, question start, ids with the answer and EOS, first answer token) of a
    sample whose BOS + context + query encodes jointly as `ids`, as the task rows place the
    question (torchtitan_ext/data/task_data.py): "continue" one document (question start 0),
    "new_segment" context and question encoded apart."""
    if question == "continue":
        return (ids, 0, *with_answer(task, sample, ids, tokenizer))
    full, start, query = split_with_answer(task, sample, tokenizer)
    return full[:query] + tokenizer.encode(sample.query, add_bos=False, add_eos=False), query, full, start


def questions(args: argparse.Namespace, loaded: list) -> list[str]:
    """Each checkpoint's question placement: --question, or new_segment for a MoNe model and
    continue for the others; UserError for new_segment on a model without segments."""
    chosen = per_checkpoint(args.question, len(loaded), "--question")
    out = []
    for (entry, _), question in zip(loaded, chosen):
        fits = segment_memory(entry.model)
        if question == "new_segment" and not fits:
            raise UserError(f"--question new_segment needs a model whose every block is MoNe, which {entry.label} is "
                            "not: pass --question continue")
        out.append(question or ("new_segment" if fits else "continue"))
    return out


def load_entries(args: argparse.Namespace) -> tuple[list, object]:
    """([(Entry, tokenizer folder)] of every --checkpoint, their one tokenizer)."""
    from torchtitan_ext.data.tokenizer import AssetsTokenizer

    count = len(args.checkpoint)
    configs = per_checkpoint(args.config, count, "--config")
    modes = per_checkpoint(args.mode, count, "--mode", "full")
    labels = per_checkpoint(args.label, count, "--label")
    loaded = [load_entry(c, cfg, m, lab, None, None) for c, cfg, m, lab in zip(args.checkpoint, configs, modes, labels)]
    if len({folder for _, folder in loaded}) > 1:
        raise UserError("the checkpoints use different tokenizers: evaluate them separately")
    return loaded, AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=loaded[0][1])


def run(args: argparse.Namespace) -> dict:
    """Score and answer perplexity per task and length of every --checkpoint, checkpoints of one
    label, mode and question pooled as seeds (module docstring) -> a JSON-able dict."""
    from tqdm import tqdm

    tasks = args.tasks.split(",")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise UserError(f"unknown task(s) {unknown}: choose from {list(TASKS)}, or --tasks babilong alone")
    lengths = sorted(int(n) for n in args.context_lengths.split(","))
    loaded, tokenizer = load_entries(args)
    seeds: dict = {}
    for checkpoint, (entry, _), question in zip(args.checkpoint, loaded, questions(args, loaded)):
        for length in lengths:
            if length + max(args.answer_tokens, MAX_ANSWER_TOKENS) > entry.max_seq_len and entry.mode == "full":
                raise UserError(f"{entry.label} takes at most {entry.max_seq_len} tokens in one pass: use shorter "
                                "--context-lengths or --mode streaming")
        cells = {}  # task -> length -> per-sample scores and answer NLLs
        for task in tasks:
            for length in lengths:
                rng = random.Random(f"{args.seed}-{task}-{length}")
                results, nlls = [], []
                for _ in tqdm(range(args.samples), desc=f"{entry.label} {task} @ {length}", file=sys.stderr):
                    ids, sample = fit_sample(task, rng, tokenizer, length, args.haystack)
                    prompt, query, full, start = encode_prompt(task, sample, ids, tokenizer, question)
                    output = tokenizer.decode(answer(entry, prompt, args.answer_tokens, query))
                    results.append(score(task, output, sample.answers))
                    nlls.append(answer_nll(entry, full, start, query))
                cells.setdefault(task, {})[str(length)] = (results, nlls)
        seeds.setdefault((entry.label, entry.mode, question), []).append((checkpoint, cells))
    runs = [{"label": label, "mode": mode, "question": question, "checkpoints": [c for c, _ in group],
             "scores": {task: {n: summarize_seeds([cells[task][n][0] for _, cells in group], "mean")
                               for n in group[0][1][task]} for task in tasks},
             "answer_ppl": {task: {n: summarize_seeds([cells[task][n][1] for _, cells in group], "exp_mean")
                                   for n in group[0][1][task]} for task in tasks}}
            for (label, mode, question), group in seeds.items()]
    return {"tasks": tasks, "context_lengths": lengths, "samples": args.samples,
            "haystack": args.haystack or "paper", "runs": runs}


def run_babilong(args: argparse.Namespace) -> dict:
    """BABILong by the thesis' protocol (torchtitan_ext/eval/babilong.py): the official files
    of --babilong-path, or generated stories; the question placed as --question says;
    checkpoints of one --label, mode and question are that model's seeds."""
    tasks = args.babilong_tasks.split(",") if args.babilong_tasks else list(
        babilong.TASKS if args.babilong_path else babilong.GENERATED_TASKS)
    unknown = [t for t in tasks if t not in babilong.TASKS]
    if unknown:
        raise UserError(f"unknown BABILong task(s) {unknown}: choose from {list(babilong.TASKS)}")
    lengths = [babilong.length_name(n) if args.babilong_path else n.strip() for n in args.context_lengths.split(",")]
    samples = args.samples or babilong.SAMPLES
    official = babilong.read_official(args.babilong_path, tasks, lengths, samples) if args.babilong_path else None
    loaded, tokenizer = load_entries(args)
    cells = babilong.items(tasks, lengths, samples, args.seed, tokenizer, official)
    new_tokens = args.answer_tokens or babilong.ANSWER_TOKENS
    longest = max(len(ids) for rows in cells.values() for ids, _ in rows)
    for entry, _ in loaded:
        if entry.mode == "full" and longest + new_tokens > entry.max_seq_len:
            raise UserError(f"{entry.label} takes at most {entry.max_seq_len} tokens in one pass, a sample and its "
                            f"answer take {longest + new_tokens}: use shorter --context-lengths or --mode streaming")
    seeds: dict = {}
    for checkpoint, (entry, _), question in zip(args.checkpoint, loaded, questions(args, loaded)):
        cells_out = babilong.evaluate(lambda ids, query: answer(entry, ids, new_tokens, query), cells, tokenizer,
                                      question, entry.label)
        seeds.setdefault((entry.label, entry.mode, question), []).append((checkpoint, cells_out))
    source = f"official files in {args.babilong_path}" if args.babilong_path else \
        "generated stories in held-out embedded text"
    return {"source": source, "tasks": tasks, "lengths": lengths, "samples": len(next(iter(cells.values()))),
            "answer_tokens": new_tokens, "prompt": babilong.CONTEXT.format("{input}") + babilong.QUERY.format("{question}"),
            "models": [babilong.summarize(*key, [c for c, _ in runs], [r for _, r in runs]) for key, runs in seeds.items()]}


def run_gradmem(args: argparse.Namespace) -> dict:
    """Exact match from the written memory per (label, K) and number of pairs; checkpoints
    sharing a label are one model's seeds (`torchtitan_ext.eval.gradmem_kv.pool_cells`)."""
    from models.grafts.gradmem import GradMemLM
    from torchtitan_ext.eval.gradmem_kv import kv_cell, pool_cells
    from torchtitan_ext.data.tokenizer import AssetsTokenizer

    count = len(args.checkpoint)
    if any(m != "gradmem" for m in per_checkpoint(args.mode, count, "--mode", "gradmem")):
        raise UserError("--mode gradmem evaluates GradMem checkpoints only: give it to every --checkpoint")
    pairs = [int(n) for n in args.pairs.split(",")]
    steps = [int(k) for k in args.write_steps.split(",")]
    if min(pairs) < 1 or min(steps) < 1:
        raise UserError("--pairs and --write-steps take counts of at least 1 (K = 0 writes nothing)")
    configs, labels = per_checkpoint(args.config, count, "--config"), per_checkpoint(args.label, count, "--label")
    runs: dict[tuple, list] = {}
    for checkpoint, config, label in zip(args.checkpoint, configs, labels):
        entry, folder = load_entry(checkpoint, config, "full", label, None, None)
        model = entry.model
        if not isinstance(model, GradMemLM):
            raise UserError(f"{entry.label} is not a GradMem model: --mode gradmem needs a train_configs.gradmem config")
        tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=folder)
        write = model.gradmem.cfg.write
        for k in (steps if write == "gradient" else [model.gradmem.cfg.write_steps]):
            runs.setdefault((entry.label, write, k), []).append(
                [kv_cell(model, tokenizer, n, k, args.samples, args.seed) for n in pairs])
    rows = [{"label": label, "write": write, "k": k, "seeds": len(seeds),
             "cells": [pool_cells(list(same)) for same in zip(*seeds)]} for (label, write, k), seeds in runs.items()]
    return {"pairs": pairs, "samples": args.samples, "rows": rows}


def gradmem_markdown(results: dict) -> str:
    pairs = results["pairs"]
    lines = [f"KV-retrieval exact match (%) from the memory alone, {results['samples']} samples per cell and seed "
             "(95% interval resampling seeds, then samples; each seed's figure after it).", "",
             "| model | WRITE | K | " + " | ".join(map(str, pairs)) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in pairs) + " |"]
    for row in results["rows"]:
        cells = [format_summary(c["summary"], 100) for c in row["cells"]]
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
    header = ["| model | mode | question | seeds | task | " + " | ".join(map(str, lengths)) + " |",
              "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in lengths) + " |"]
    lines = [f"Synthetic memory tasks, {results['samples']} samples per cell (kv_retrieval: exact match; niah: "
             f"substring match; fwe: recall of the top-3 words); needle haystack: {results['haystack']}. Each cell: "
             "the pooled figure (95% interval: seeds resampled, then samples), then each seed's.", "", *header]
    for key, title in (("scores", None), ("answer_ppl", "Answer perplexity (answer and EOS tokens given the prompt):")):
        if title:
            lines += ["", title, "", *header]
        for run in results["runs"]:
            for task, by_length in run[key].items():
                lines.append(f"| {run['label']} | {run['mode']} | {run['question']} | {len(run['checkpoints'])} | "
                             f"{task} | " + " | ".join(format_summary(by_length[str(n)], digits=2) for n in lengths)
                             + " |")
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
            ax.plot(lengths, [run["scores"][task][str(n)]["pooled"] for n in lengths], marker="o",
                    label=f"{run['label']} ({run['mode']}, {run['question']})")
        ax.set(title=task, xscale="log", xlabel="context length (tokens)", ylabel="score", ylim=(-0.05, 1.05))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(lengths, [str(n) for n in lengths])
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
