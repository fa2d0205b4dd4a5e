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
