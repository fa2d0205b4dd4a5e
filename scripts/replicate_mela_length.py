"""Small-scale replication of Mela's length claim, with controls.

Paper: "Mela: Test-Time Memory Consolidation based on Transformation Hypothesis"
(arXiv:2605.10537), Figure 4.

The paper's claim: Mela's perplexity stays on the same order as the context grows past the
training length, while a Transformer's degrades. Any model whose attention spans one chunk
is flat in length by construction, so the claim is read through two effects:

- memory effect = Mela vs Mela with its memory path off (`memory_path=False`: every decoder
  chunk reads `memory_init`; same decoder, same window), both chains of the memory across
  the recursion depth (`memory_chain` per_step and per_block), at the default step after
  Newton-Schulz (`memory_step_scale` 0.1; its comparison with eq. 10's unit step is
  docs/mela_step_scale.json);
- window effect = a Transformer++ (torchtitan's llama3, `transformer_small`, the same 2.4M
  parameters as `mela_debug`) with Mela's chunk-local mask and positions vs the same
  Transformer with full causal attention over its training context.

Setup: `mela_debug` (P = C = 8, so P*C = 64 tokens) trains at a 128-token context, the
paper's P*C : context ratio of 1/2 (2048 : 4096). Every model trains in this process with
the same loop (AdamW, warm-up then cosine, batch 16, same data order per seed), for each
of `--seeds` seeds. Data: the embedded CPython corpus; every other document of at least
8x the context is held out (44 documents), the rest is the training stream. Evaluation:
each held-out document's first 8x-context tokens in one causal pass; perplexity at 1x,
2x, 4x, 8x the training context is that of each prefix. Intervals: 95% two-level
bootstrap, seeds resampled, then documents inside each (torchtitan_ext/eval/stats.py, 2000
resamples), each seed's figure beside the pooled one; the effects are ratios of
perplexities paired by seed and document. Loss by position inside a decoder chunk
(P*C = 64 positions) shows where the memory helps.

    python scripts/replicate_mela_length.py --out outputs/replication [--steps 200] [--seeds 3]
Writes <out>/results.json, results.md and replication.png; each trained (model, seed) is kept
in <out>/cells/, so an interrupted run picks up where it stopped when rerun.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from torchtitan_ext.eval.stats import summarize_seeds

CONTEXT = 128  # training context: 2 Mela chunks of P*C = 64 tokens
CHUNK = 64  # P*C of mela_debug
EVAL_MULTIPLES = (1, 2, 4, 8)
BATCH, LR, WEIGHT_DECAY = 16, 3e-3, 0.1


@dataclass(frozen=True)
class Variant:
    """One model of the comparison: `build(seed)` -> (model, logits(model, tokens))."""

    name: str
    build: Callable


def mela_variant(name: str, **fields) -> Variant:
    def build(seed: int):
        from models.lms.mela import Mela
        from torchtitan_ext.families.mela import model_config

        torch.manual_seed(seed)
        return Mela(model_config("debug", **fields)), lambda model, tokens: model(tokens)

    return Variant(name, build)


def transformer_variant(name: str, chunk_local: bool) -> Variant:
    def build(seed: int):
        from torchtitan.models.common.attention import create_varlen_metadata_for_document

        from torchtitan_ext.families.transformer import model_config

        torch.manual_seed(seed)
        model = model_config("small", "cpu").build()
        model.init_weights(buffer_device=None)

        def logits(model, tokens):
            positions = torch.arange(tokens.shape[1])
            if chunk_local:  # positions restart every chunk: each chunk is one attention "document"
                positions = positions % CHUNK
            positions = positions.expand_as(tokens)
            return model(tokens, positions=positions, attention_masks=create_varlen_metadata_for_document(positions))

        return model, logits

    return Variant(name, build)


VARIANTS = [
    mela_variant("mela (per_step)", memory_chain="per_step"),
    mela_variant("mela (per_block)", memory_chain="per_block"),
    mela_variant("mela, memory path off", memory_path=False),
    transformer_variant("transformer, chunk-local", chunk_local=True),
    transformer_variant("transformer, full", chunk_local=False),
]


def load_corpus(min_eval_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(training token stream, held-out documents): every other document with at least
    `min_eval_tokens` tokens is held out, cut to that length."""
    from torchtitan_ext.data import default_tokenizer
    from torchtitan_ext.data.embedded_corpus import embedded_documents
    from torchtitan_ext.data.tokenizer import AssetsTokenizer

    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(default_tokenizer.build().parent))
    train, held_out, long_docs = [], [], 0
    for doc in embedded_documents():
        ids = tokenizer.encode(doc, add_bos=True, add_eos=True)
        is_long = len(ids) >= min_eval_tokens
        long_docs += is_long
        if is_long and long_docs % 2:
            held_out.append(torch.tensor(ids[:min_eval_tokens]))
        else:
            train.extend(ids)
    return torch.tensor(train), held_out


def train(variant: Variant, stream: torch.Tensor, seed: int, steps: int):
    """The model of `variant` trained for `steps` on random CONTEXT+1 windows of `stream`
    (the same windows for every variant of a seed). Returns (model, logits fn, final loss)."""
    model, logits_of = variant.build(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.95))
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.1 + 0.45 * (
        1 + math.cos(math.pi * min(1.0, max(0, s - warmup) / max(1, steps - warmup))))))
    data = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - CONTEXT - 1, (BATCH,), generator=data)
        window = torch.stack([stream[s : s + CONTEXT + 1] for s in starts.tolist()])
        logits = logits_of(model, window[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), window[:, 1:].flatten())
        if not torch.isfinite(loss):
            raise SystemExit(f"error: {variant.name} seed {seed}: loss is {loss.item()}: lower LR in this script")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    return model.eval(), logits_of, loss.item()


@torch.no_grad()
def token_losses(model, logits_of, docs: list[torch.Tensor]) -> torch.Tensor:
    """(docs, L - 1) NLL of each document's tokens 1.. in one causal pass."""
    losses = []
    for doc in docs:
        logits = logits_of(model, doc[None, :-1]).float()
        losses.append(torch.nn.functional.cross_entropy(logits[0], doc[1:], reduction="none"))
    return torch.stack(losses)


def precision_gap(model, logits_of, doc: torch.Tensor) -> float:
    """Largest |fp32 logit - fp64 logit| over the last decoder chunk of one held-out
    document (8x the training context): how far rounding has been amplified by then."""
    with torch.no_grad():
        single = logits_of(model, doc[None, :-1])[0, -CHUNK:].double()
        double = logits_of(model.double(), doc[None, :-1])[0, -CHUNK:]
        model.float()
    return (single - double).abs().max().item()


def summarize(losses: dict[str, torch.Tensor]) -> dict:
    """losses: name -> (seeds, docs, L - 1). Perplexity with interval per prefix length,
    paired effect ratios, loss by position inside a chunk."""
    lengths = [CONTEXT * k for k in EVAL_MULTIPLES]
    runs = {}
    for name, nll in losses.items():
        seed_mean = nll.mean(0)  # (docs, L - 1)
        per_length = {}
        for length in lengths:
            summary = summarize_seeds(list(nll[:, :, : length - 1].mean(2)), statistic="exp_mean")
            per_length[str(length)] = {"ppl": summary["pooled"], "ci95": summary["ci95"],
                                       "seeds": [s["value"] for s in summary["per_seed"]]}
        targets = torch.arange(1, seed_mean.shape[1] + 1)
        past_first = targets >= CHUNK  # chunk 0 reads no memory in any model
        by_position = [seed_mean[:, past_first & (targets % CHUNK == p)].mean().item() for p in range(CHUNK)]
        runs[name] = {"results": per_length, "loss_by_chunk_position": by_position}
    effects = {}
    for label, model, control in (("memory effect: mela (per_step) / memory path off", "mela (per_step)",
                                   "mela, memory path off"),
                                  ("memory effect: mela (per_block) / memory path off", "mela (per_block)",
                                   "mela, memory path off"),
                                  ("chain: per_block / per_step", "mela (per_block)", "mela (per_step)"),
                                  ("window effect: transformer chunk-local / full", "transformer, chunk-local",
                                   "transformer, full")):
        if model not in losses or control not in losses:
            continue
        diff = losses[model] - losses[control]  # (seeds, docs, L - 1), paired by seed and document
        effects[label] = {}
        for n in lengths:
            summary = summarize_seeds(list(diff[:, :, : n - 1].mean(2)), statistic="exp_mean")
            effects[label][str(n)] = {"ratio": summary["pooled"], "ci95": summary["ci95"],
                                      "seeds": [s["value"] for s in summary["per_seed"]]}
    seeds, documents = next(iter(losses.values())).shape[:2]
    return {"context": CONTEXT, "chunk_tokens": CHUNK, "lengths": lengths, "documents": documents, "seeds": seeds,
            "runs": runs, "effects": effects}


def markdown(results: dict, steps: int) -> str:
    lengths = results["lengths"]
    head = "| model | " + " | ".join(f"ppl @ {n}" for n in lengths) + " |"
    lines = [f"Training context {results['context']} tokens, {steps} steps, {results['seeds']} seeds, "
             f"{results['documents']} held-out documents; perplexity (95% interval, seeds then documents "
             "resampled; each seed's figure after it).", "", head, "|" + " --- |" * (len(lengths) + 1)]

    def cell(value: float, entry: dict, digits: int) -> str:
        seeds = ", ".join(f"{s:.{digits}f}" for s in entry["seeds"])
        return f"{value:.{digits}f} ({entry['ci95'][0]:.{digits}f}-{entry['ci95'][1]:.{digits}f}); seeds {seeds}"

    for name, run in results["runs"].items():
        lines.append(f"| {name} | " + " | ".join(cell(r["ppl"], r, 1) for r in run["results"].values()) + " |")
    lines += ["", "| ratio of perplexities (paired by seed and document) | " + " | ".join(str(n) for n in lengths)
              + " |", "|" + " --- |" * (len(lengths) + 1)]
    for label, per_length in results["effects"].items():
        lines.append(f"| {label} | " + " | ".join(cell(e["ratio"], e, 3) for e in per_length.values()) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    lengths = results["lengths"]
    for name, run in results["runs"].items():
        ppl = [run["results"][str(n)]["ppl"] for n in lengths]
        errors = [[p - run["results"][str(n)]["ci95"][0] for p, n in zip(ppl, lengths)],
                  [run["results"][str(n)]["ci95"][1] - p for p, n in zip(ppl, lengths)]]
        left.errorbar(lengths, ppl, yerr=errors, marker="o", capsize=3, label=name)
        right.plot(range(results["chunk_tokens"]), run["loss_by_chunk_position"], label=name)
    left.set(xscale="log", xlabel="context (tokens)", ylabel="perplexity (95% CI)", xticks=lengths,
             xticklabels=[str(n) for n in lengths], title=f"trained at {results['context']} tokens")
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    right.set(xlabel="position inside the decoder chunk (P*C = 64)", ylabel="mean loss (chunks 1..)",
              title="loss by position in chunk")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def trained_cell(variant: Variant, stream: torch.Tensor, docs: list[torch.Tensor], seed: int,
                 args: argparse.Namespace) -> dict:
    """One (variant, seed): {"losses": (docs, L - 1) held-out NLL, "gap": fp32-fp64 logit gap},
    trained and scored, or read back from <out>/cells/ where an earlier (interrupted) run of
    the same steps left it; each cell is written atomically once done, so a rerun resumes."""
    path = args.out / "cells" / f"{variant.name.replace(' ', '_').replace(',', '')}_steps{args.steps}_seed{seed}.pt"
    if path.exists():
        return torch.load(path)
    start = time.time()
    model, logits_of, final = train(variant, stream, seed, args.steps)
    cell = {"losses": token_losses(model, logits_of, docs), "gap": precision_gap(model, logits_of, docs[0])}
    print(f"{variant.name} seed {seed}: final train loss {final:.3f}, held-out loss {cell['losses'].mean():.3f}, "
          f"fp32-fp64 logit gap {cell['gap']:.2e} ({time.time() - start:.0f} s)", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(cell, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/replication"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", action="append", help="a variant's name (repeatable; default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stream, docs = load_corpus(CONTEXT * EVAL_MULTIPLES[-1])
    print(f"training stream {len(stream):,} tokens; {len(docs)} held-out documents of {len(docs[0])} tokens")
    chosen = [v for v in VARIANTS if not args.only or v.name in args.only]
    losses, gaps = {}, {}
    for variant in chosen:
        cells = [trained_cell(variant, stream, docs, seed, args) for seed in range(args.seeds)]
        losses[variant.name] = torch.stack([cell["losses"] for cell in cells])
        gaps[variant.name] = [cell["gap"] for cell in cells]
    results = summarize(losses) | {"steps": args.steps, "fp32_fp64_logit_gap": gaps}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "results.md").write_text(markdown(results, args.steps))
    plot(results, args.out / "replication.png")
    print(markdown(results, args.steps))


if __name__ == "__main__":
    main()
