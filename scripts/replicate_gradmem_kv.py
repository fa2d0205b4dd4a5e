"""GradMem's Table 1 direction at CPU scale: gradient WRITE against forward WRITE (RMT) on
KV-retrieval with the context removed, and K = 5 against K = 1 gradient steps.

    python scripts/replicate_gradmem_kv.py --out docs/gradmem_kv --flavor kv_debug --seeds 0,1 \\
        --stages 4,8,16 --steps 300 --methods forward:1,gradient:1,gradient:5 --eval-pairs 4,8,16 --eval-k 1,2,5

Each method (WRITE kind : training K) trains from scratch on `--flavor` (torchtitan_ext/gradmem.py)
through a curriculum over the number of pairs (each stage starts from the previous stage's
weights, as the paper's appendix C), with the family's outer loss (read cross-entropy on the
answer + 0.5 x the last inner step's write loss), AdamW and the task data of the torchtitan
path (`TaskDataset`, rows split at the query). The loop is plain torch in one process
(the same model, data and loss as `bash scripts/train.sh --module train_configs.gradmem`,
without the launcher's per-run start-up on a 2-core machine). After the last stage, exact
match from the memory alone on held-out samples at each `--eval-pairs`, for each `--eval-k`
(gradient methods; the forward method at its training K), with the final write loss; 95%
Wilson intervals over the samples of all seeds. Writes results.json, results.md and
gradmem_kv.png to --out (staged, moved into place at the end).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def parse_methods(text: str) -> list[tuple[str, int]]:
    methods = []
    for item in text.split(","):
        write, _, k = item.partition(":")
        methods.append((write, int(k or 1)))
    return methods


def batches(tokenizer, pairs: int, batch: int, seed: int):
    """(tokens, positions, labels) of `batch` training rows with `pairs` pairs, forever."""
    from torchtitan_ext.task_data import TaskDataset

    dataset = TaskDataset(["kv_retrieval"], tokenizer, 7 * pairs + 9, seed, False, True, 0, 0, 1,
                          split_context=True, pairs=(pairs,))
    rows = iter(dataset)
    while True:
        items = [next(rows) for _ in range(batch)]
        yield (torch.stack([x["input"] for x, _ in items]), torch.stack([x["positions"] for x, _ in items]),
               torch.stack([y for _, y in items]))


def train(args, write: str, k: int, seed: int, tokenizer, log) -> torch.nn.Module:
    from torchtitan_ext.gradmem import model_config, weighted_write_loss, WRITE_LOSS_WEIGHT
    from models.lms.gradmem import GradMemLM

    torch.manual_seed(seed)
    model = GradMemLM(model_config(args.flavor, gradmem={"write": write, "write_steps": k, "inner_lr": args.inner_lr}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = 0
    for pairs in args.stages:
        data = batches(tokenizer, pairs, args.batch, seed)
        start = time.time()
        for _ in range(args.steps):
            tokens, positions, labels = next(data)
            lr_scale = min(1.0, (step + 1) / args.warmup)
            for group in optimizer.param_groups:
                group["lr"] = args.lr * lr_scale
            logits, write_loss = model(tokens, positions)
            read = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            loss = (read + weighted_write_loss(write_loss, labels, WRITE_LOSS_WEIGHT)) / (labels != -100).sum()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            if step % 50 == 0:
                log(f"{write}:{k} seed {seed} pairs {pairs} step {step}: loss {loss.item():.4f}, "
                    f"write {write_loss.mean().item():.4f}, {(time.time() - start) / 50:.2f} s/step")
                start = time.time()
    return model


def evaluate(model, tokenizer, pairs: int, k: int, samples: int) -> tuple[list[float], float]:
    """(per-sample exact match, mean final write loss) on held-out samples."""
    from torchtitan_ext.gradmem import exact_match
    from torchtitan_ext.synthetic_tasks import kv_pairs

    rng = random.Random(f"gradmem-kv-eval-{pairs}")
    items = [kv_pairs(rng, pairs) for _ in range(samples)]
    model.eval()
    scores = []
    for start in range(0, samples, 64):
        scores += exact_match(model, tokenizer, items[start:start + 64], k)
    context = [tokenizer.encode(s.context, add_bos=True, add_eos=False) for s in items[:64]]
    lengths = torch.tensor([len(c) for c in context])
    tokens = torch.tensor([c + [0] * (int(lengths.max()) - len(c)) for c in context])
    memory, _ = model.write(tokens, lengths, k)
    with torch.no_grad():
        final = model.write_loss(memory, tokens, lengths).mean().item() if model.gradmem.cfg.write == "gradient" else 0.0
    model.train()
    return scores, final


def markdown(results: dict) -> str:
    pairs = results["eval_pairs"]
    lines = [f"KV-retrieval exact match from the memory alone (flavor {results['flavor']}, seeds {results['seeds']}, "
             f"{results['samples']} held-out samples per seed and cell, curriculum {results['stages']} x "
             f"{results['steps']} steps of {results['batch']}; 95% Wilson interval over samples).", "",
             "| WRITE (training K) | K at eval | " + " | ".join(f"{n} pairs" for n in pairs) + " |",
             "| --- | --- | " + " | ".join("---" for _ in pairs) + " |"]
    for row in results["rows"]:
        cells = [f"{100 * c['em']:.1f} ({100 * c['ci'][0]:.1f}-{100 * c['ci'][1]:.1f})" for c in row["cells"]]
        lines.append(f"| {row['write']} ({row['k_train']}) | {row['k_eval']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    pairs = results["eval_pairs"]
    for row in results["rows"]:
        em = [100 * c["em"] for c in row["cells"]]
        low = [100 * (c["em"] - c["ci"][0]) for c in row["cells"]]
        high = [100 * (c["ci"][1] - c["em"]) for c in row["cells"]]
        ax.errorbar(pairs, em, yerr=[low, high], marker="o", capsize=3,
                    label=f"{row['write']} K_train={row['k_train']}, K_eval={row['k_eval']}")
    ax.set(xscale="log", xlabel="key-value pairs", ylabel="exact match (%)", ylim=(-3, 103),
           title="KV-retrieval from 8 memory vectors")
    ax.set_xticks(pairs, [str(n) for n in pairs])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    from torchtitan_ext.gradmem import wilson_interval
    from torchtitan_ext.kv_tokenizer import build
    from torchtitan_ext.paths import staged_folder
    from torchtitan_ext.tokenizer import AssetsTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--flavor", default="kv_debug")
    parser.add_argument("--methods", type=parse_methods, default=parse_methods("forward:1,gradient:1,gradient:5"))
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--stages", default="4,8,16")
    parser.add_argument("--steps", type=int, default=300, help="training steps per curriculum stage")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--inner-lr", type=float, default=0.04)
    parser.add_argument("--eval-pairs", default="4,8,16")
    parser.add_argument("--eval-k", default="1,2,5")
    parser.add_argument("--samples", type=int, default=128, help="held-out samples per seed and cell")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    args.stages = [int(n) for n in args.stages.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    eval_pairs = [int(n) for n in args.eval_pairs.split(",")]
    eval_k = [int(k) for k in args.eval_k.split(",")]
    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(build()))

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    rows = []
    for write, k in args.methods:
        per_cell: dict[tuple[int, int], list] = {}
        for seed in seeds:
            model = train(args, write, k, seed, tokenizer, log)
            for k_eval in (eval_k if write == "gradient" else [k]):
                for pairs in eval_pairs:
                    scores, final = evaluate(model, tokenizer, pairs, k_eval, args.samples)
                    per_cell.setdefault((k_eval, pairs), []).append((scores, final))
                    log(f"{write}:{k} seed {seed} K_eval {k_eval} pairs {pairs}: EM {sum(scores) / len(scores):.3f}, "
                        f"final write loss {final:.4f}")
        for k_eval in sorted({ke for ke, _ in per_cell}):
            cells = []
            for pairs in eval_pairs:
                runs = per_cell[(k_eval, pairs)]
                scores = [s for run, _ in runs for s in run]
                cells.append({"pairs": pairs, "em": sum(scores) / len(scores), "ci": wilson_interval(sum(scores), len(scores)),
                              "em_per_seed": [sum(run) / len(run) for run, _ in runs],
                              "final_write_loss_per_seed": [final for _, final in runs]})
            rows.append({"write": write, "k_train": k, "k_eval": k_eval, "cells": cells})
    results = {"flavor": args.flavor, "seeds": seeds, "stages": args.stages, "steps": args.steps, "batch": args.batch,
               "lr": args.lr, "inner_lr": args.inner_lr, "samples": args.samples, "eval_pairs": eval_pairs, "rows": rows}
    with staged_folder(args.out) as staging:
        (staging / "results.json").write_text(json.dumps(results, indent=2))
        (staging / "results.md").write_text(markdown(results))
        plot(results, staging / "gradmem_kv.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
