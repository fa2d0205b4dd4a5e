"""GradMem's KV-retrieval scoring (paper 001, Table 1's exact match): greedy answers read
from the written memory alone, exact match per sample, one table cell per (pairs, WRITE
steps), and cells of several training seeds pooled with intervals over seeds, then samples."""

from __future__ import annotations

import random

import torch

from models.grafts.gradmem import GradMemLM
from torchtitan_ext.data.synthetic_tasks import kv_pairs, score
from torchtitan_ext.errors import UserError
from torchtitan_ext.eval.stats import summarize_seeds


def answer_batch(model: GradMemLM, tokenizer, samples: list, new_tokens: int, steps: int | None = None) -> list[str]:
    """Greedy answers (text) of task samples from the written memory alone: each context is
    written, each query read with it; samples are batched by query length."""
    contexts = [tokenizer.encode(s.context, add_bos=True, add_eos=False) for s in samples]
    queries = [tokenizer.encode(s.query, add_bos=False, add_eos=False) for s in samples]
    answers: list[str] = [""] * len(samples)
    for length in sorted({len(q) for q in queries}):
        group = [i for i, q in enumerate(queries) if len(q) == length]
        lengths = torch.tensor([len(contexts[i]) for i in group])
        context = torch.zeros(len(group), int(lengths.max()), dtype=torch.long)
        for row, i in enumerate(group):
            context[row, : len(contexts[i])] = torch.tensor(contexts[i])
        query = torch.tensor([queries[i] for i in group])
        for row, ids in zip(group, model.generate(context, lengths, query, new_tokens, steps).tolist()):
            answers[row] = tokenizer.decode(ids)
    return answers


def exact_match(model: GradMemLM, tokenizer, samples: list, steps: int | None = None) -> list[float]:
    """Per-sample KV-retrieval exact match of the value answered from the memory."""
    answers = answer_batch(model, tokenizer, samples, 2, steps)
    return [score("kv_retrieval", a, s.answers) for a, s in zip(answers, samples)]


def kv_cell(model: GradMemLM, tokenizer, pairs: int, steps: int, samples: int, seed: int | str,
            batch: int = 64) -> dict:
    """One cell of the exact-match table: `samples` held-out KV-retrieval samples of `pairs`
    pairs (drawn from `seed`), written with `steps` WRITE steps and answered from the memory ->
    {"pairs", "scores" (per sample, 0 / 1), "write_loss" (L_write(M_K) averaged over the first
    `batch` samples; None for the forward write)} | `em_summary([scores])`. UserError when the
    samples do not fit the model's max_seq_len."""
    rng = random.Random(f"{seed}-gradmem-kv-{pairs}")
    items = [kv_pairs(rng, pairs) for _ in range(samples)]
    longest = max(len(tokenizer.encode(s.context + s.query, add_bos=True, add_eos=False)) for s in items)
    if longest + model.gradmem.cfg.n_mem + 4 > model.cfg.max_seq_len:
        raise UserError(f"{pairs} pairs take {longest} tokens, more than the model's max_seq_len "
                        f"{model.cfg.max_seq_len} holds with its memory: use fewer pairs")
    scores: list[float] = []
    for start in range(0, samples, batch):
        scores += exact_match(model, tokenizer, items[start:start + batch], steps)
    write_loss = None
    if model.gradmem.cfg.write == "gradient":
        context = [tokenizer.encode(s.context, add_bos=True, add_eos=False) for s in items[:batch]]
        lengths = torch.tensor([len(c) for c in context])
        tokens = torch.tensor([c + [0] * (int(lengths.max()) - len(c)) for c in context])
        memory, _ = model.write(tokens, lengths, steps)
        with torch.no_grad():
            write_loss = model.write_loss(memory, tokens, lengths).mean().item()
    return {"pairs": pairs, "scores": scores, "write_loss": write_loss, **em_summary([scores])}


def em_summary(per_seed: list[list[float]]) -> dict:
    """Exact match of one cell over one or more training seeds (per-sample 0 / 1 scores of
    each): {"em" (pooled), "ci" (95%, seeds resampled then samples: `stats.summarize_seeds`,
    statistic "mean"; one seed: samples only), "summary" (the per-seed figures beside it)}."""
    summary = summarize_seeds(per_seed, statistic="mean")
    return {"em": summary["pooled"], "ci": summary["ci95"], "summary": summary}


def pool_cells(cells: list[dict]) -> dict:
    """The same `kv_cell` of several training seeds as one: `em_summary` over their scores,
    with each seed's scores and final write loss kept."""
    return {"pairs": cells[0]["pairs"], "scores_per_seed": [c["scores"] for c in cells],
            "write_loss_per_seed": [c["write_loss"] for c in cells], **em_summary([c["scores"] for c in cells])}
