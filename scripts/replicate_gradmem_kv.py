"""GradMem's Table 1 direction at CPU scale: gradient WRITE against forward WRITE (RMT) on
KV-retrieval with the context removed, and K = 5 against K = 1 gradient steps. The two runs
of docs/benchmarks.md "GradMem":

    python scripts/replicate_gradmem_kv.py --out docs/gradmem_kv/write_kind --seeds 0,1 \\
        --methods gradient:1,forward:1 --stages 1,2,4,8,16 --steps 150,200,400,1200,2400 --replay \\
        --lr 3e-3 --inner-lr 1.0 --eval-pairs 4,8,16,32 --eval-k 1
    python scripts/replicate_gradmem_kv.py --out docs/gradmem_kv/write_steps --seeds 0,1 \\
        --methods gradient:5:0.25,gradient:1:1.0 --stages 1,2,4,8 --steps 200,300,800,2000 --replay \\
        --lr 1e-3 --eval-pairs 4,8,16 --eval-k 1,5

Each method (WRITE kind : training K [: alpha [: meta-gradient]]; meta-gradient "second" by
default, "first" for Table 1's "w/o meta-learning", models/memory/gradmem.py) trains from scratch on `--flavor`
(torchtitan_ext/families/gradmem.py) through a curriculum over the number of pairs (each stage starts
from the previous stage's weights, as the paper's appendix C; with `--replay` a stage draws
each sample's pair count from all the stages so far, so the short contexts are not
forgotten), with the family's outer loss (read cross-entropy on the answer + `--write-weight`
x the last inner step's write loss: 0.5, the public code's; 0 with `--projection` is the paper
text's setting, train_configs.gradmem `gradmem_kv_paper_text`), AdamW (0.9, 0.95), linear warmup, and the task data of the torchtitan
path (`TaskDataset`, rows split at the query). The loop is plain torch in one process
(the same model, data and loss as `bash scripts/train.sh --module train_configs.gradmem`,
without the launcher's per-run start-up on a 2-core machine). After the last stage, exact
match from the memory alone on held-out samples at each `--eval-pairs`, for each `--eval-k`
(gradient methods; the forward method at its training K), with the final write loss; the
seeds pooled with a 95% interval that resamples seeds, then samples (torchtitan_ext/eval/stats.py),
each seed's figure beside it, and every sample's score in results.json. Writes results.json, results.md and
gradmem_kv.png (the table and plot of `eval_tasks.py --mode gradmem`, torchtitan_ext/eval/tasks.py) to --out (staged,
moved into place at the end).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def parse_methods(text: str) -> list[tuple[str, int, float | None, str]]:
    """"write:K[:alpha[:meta_gradient]],..." -> [(write, K, alpha or None for --inner-lr,
    meta_gradient, default "second")]."""
    from models.memory.gradmem import META_GRADIENTS, WRITES

    methods = []
    for item in text.split(","):
        write, *rest = item.split(":")
        meta_gradient = rest[2] if len(rest) > 2 else "second"
        if write not in WRITES or meta_gradient not in META_GRADIENTS:
            raise ValueError(f"method '{item}': WRITE is one of {WRITES}, meta_gradient one of {META_GRADIENTS}")
        methods.append((write, int(rest[0]) if rest else 1, float(rest[1]) if len(rest) > 1 and rest[1] else None,
                        meta_gradient))
    return methods


def batches(tokenizer, pairs: tuple[int, ...], batch: int, seed: int):
    """(tokens, positions, labels) of `batch` training rows, each with a pair count drawn from `pairs`, forever."""
    from torchtitan_ext.data.task_data import TaskDataset
    from train_configs.gradmem import kv_row

    dataset = TaskDataset(["kv_retrieval"], tokenizer, kv_row(max(pairs)), seed, False, True, 0, 0, 1,
                          split_context=True, pairs=pairs)
    rows = iter(dataset)
    while True:
        items = [next(rows) for _ in range(batch)]
        yield (torch.stack([x["input"] for x, _ in items]), torch.stack([x["positions"] for x, _ in items]),
               torch.stack([y for _, y in items]))


def train(args, write: str, k: int, alpha: float, meta_gradient: str, seed: int, tokenizer, log) -> torch.nn.Module:
    from torchtitan_ext.families.gradmem import model_config
    from torchtitan_ext.families.gradmem_loss import weighted_write_loss
    from models.grafts.gradmem import GradMemLM

    torch.manual_seed(seed)
    model = GradMemLM(model_config(args.flavor, gradmem={"write": write, "write_steps": k, "inner_lr": alpha,
                                                         "meta_gradient": meta_gradient,
                                                         "memory_projection": args.projection}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = 0
    for stage, (pairs, steps) in enumerate(zip(args.stages, args.steps)):
        data = batches(tokenizer, tuple(args.stages[: stage + 1]) if args.replay else (pairs,), args.batch, seed)
        start = time.time()
        for _ in range(steps):
            tokens, positions, labels = next(data)
            lr_scale = min(1.0, (step + 1) / args.warmup)
            for group in optimizer.param_groups:
                group["lr"] = args.lr * lr_scale
            logits, write_loss = model(tokens, positions)
            read = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            loss = (read + weighted_write_loss(write_loss, labels, args.write_weight)) / (labels != -100).sum()
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


def main(argv: list[str] | None = None) -> None:
    from torchtitan_ext.eval.tasks import gradmem_markdown, gradmem_plot
    from torchtitan_ext.eval.gradmem_kv import kv_cell, pool_cells
    from torchtitan_ext.families.gradmem_loss import WRITE_LOSS_WEIGHT
    from torchtitan_ext.data.kv_tokenizer import build
    from torchtitan_ext.paths import write_results
    from torchtitan_ext.data.tokenizer import AssetsTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--flavor", default="kv_debug")
    parser.add_argument("--methods", type=parse_methods, default=parse_methods("forward:1,gradient:1,gradient:5:0.25"),
                        help="WRITE:K[:alpha[:meta_gradient]] per method, comma-separated")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--stages", default="1,2,4,8,16", help="curriculum: pair counts, one stage each")
    parser.add_argument("--steps", default="150,200,400,600,1000",
                        help="training steps per stage (one number: every stage)")
    parser.add_argument("--replay", action="store_true", help="a stage also draws the earlier stages' pair counts")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--inner-lr", type=float, default=1.0, help="alpha of the methods that name none")
    parser.add_argument("--write-weight", type=float, default=WRITE_LOSS_WEIGHT,
                        help="weight of the last inner write loss in the outer loss (the paper text: 0)")
    parser.add_argument("--projection", action="store_true", help="the learned memory projection (appendix C (i))")
    parser.add_argument("--eval-pairs", default="4,8,16,32")
    parser.add_argument("--eval-k", default="1,5")
    parser.add_argument("--samples", type=int, default=256, help="held-out samples per seed and cell")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    args.stages = [int(n) for n in args.stages.split(",")]
    steps = [int(n) for n in args.steps.split(",")]
    args.steps = steps * len(args.stages) if len(steps) == 1 else steps
    if len(args.steps) != len(args.stages):
        parser.error(f"--steps gives {len(args.steps)} stages' steps for {len(args.stages)} --stages")
    if args.threads:
        torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    eval_pairs = [int(n) for n in args.eval_pairs.split(",")]
    eval_k = [int(k) for k in args.eval_k.split(",")]
    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(build()))

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    rows = []
    for write, k, alpha, meta_gradient in args.methods:
        alpha = alpha or args.inner_lr
        per_cell: dict[int, list[list[dict]]] = {}
        for seed in seeds:
            model = train(args, write, k, alpha, meta_gradient, seed, tokenizer, log).eval()
            for k_eval in (eval_k if write == "gradient" else [k]):
                cells = [kv_cell(model, tokenizer, n, k_eval, args.samples, "held-out") for n in eval_pairs]
                per_cell.setdefault(k_eval, []).append(cells)
                log(f"{write}:{k} seed {seed} K_eval {k_eval}: EM " +
                    ", ".join(f"{c['pairs']} pairs {c['em']:.3f}" for c in cells))
        for k_eval, runs in per_cell.items():
            label = f"trained with K={k}" + (f", alpha {alpha}" if write == "gradient" else "")
            rows.append({"label": label + ("" if meta_gradient == "second" else f", {meta_gradient} order"),
                         "write": write, "k": k_eval, "k_train": k, "alpha": alpha, "meta_gradient": meta_gradient,
                         "seeds": len(runs), "cells": [pool_cells(list(same)) for same in zip(*runs)]})
    results = {"flavor": args.flavor, "seeds": seeds, "stages": args.stages, "steps": args.steps,
               "replay": args.replay, "batch": args.batch, "lr": args.lr, "inner_lr": args.inner_lr,
               "write_weight": args.write_weight, "projection": args.projection,
               "samples": args.samples, "pairs": eval_pairs, "rows": rows}
    table = (f"Flavor {args.flavor}, seeds {seeds}, curriculum {args.stages} pairs x {args.steps} steps of "
             f"{args.batch}{' with replay' if args.replay else ''}, lr {args.lr}, outer loss + {args.write_weight} x "
             f"write loss, memory projection {'on' if args.projection else 'off'}.\n\n"
             + gradmem_markdown(results))
    write_results(args.out, results, table, {"gradmem_kv.png": lambda path: gradmem_plot(results, path)})


if __name__ == "__main__":
    main()
