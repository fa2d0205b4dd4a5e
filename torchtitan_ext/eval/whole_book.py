"""Whole-book test-time training (the Locas paper's PG-19 protocol, section 3.2): a long
document is read chunk by chunk with a bounded attention window; each chunk is scored before
anything learns from it; what a method learns persists to the end of the document (and is
dropped before the next one). `scripts/eval_long_ppl.py --ttt METHODS` runs it.

Methods (one `Reader` each, all on one copy of the checkpoint's model per document):
- `truncated`: the window alone (the paper's "Cxt. Trunc.");
- `full`: every earlier token up to `full_window` (default: the model's max_seq_len);
- `templora`: TempLoRA, LoRA (rank r, alpha 2r) on every attention and FFN projection,
  trained on each chunk after scoring it;
- `locas_glu[:INIT]`: Locas-GLU (models/memory/locas.py), INIT one of topk (default),
  bottomk, random_select, gaussian, norm_act: initialised from the first chunk, then trained
  on each chunk, rows clipped after every update;
- `locas_mlp[:bp|nlsvd]`: Locas-MLP, slots grown from each chunk's activations and
  gradients with NL-SVD compression at 2r (nlsvd), or grown once from the first chunk and
  trained (bp, default); `Protocol.gradient` ("chunk" or the paper's per-token "token")
  picks the gradient (models/memory/locas.py).

Choices where the paper is silent (also in docs/benchmarks.md): the window holds the chunk
and up to `window - chunk` tokens before it (`chunk` < `window`; default chunk = window / 2);
`steps` AdamW updates (betas 0.9 / 0.999, no weight decay; its state kept for the document)
on the chunk's mean NLL per chunk, the first of them on the scoring forward itself (same
parameters, so scoring still precedes learning); Locas lr 4e-3 (the paper's Table 2 value),
TempLoRA its own lr. Cumulative perplexity at N tokens: per document exp of the mean NLL of
its first N scored tokens; across documents exp of the mean of those per-document means over
documents of at least N scored tokens. Seeds (`Protocol.seeds`): a method with a random draw
(TempLoRA's A init, Locas-GLU's random_select and gaussian inits) reads every document once
per seed; the others draw nothing and read each once. The 95% interval resamples seeds, then
documents inside each (torchtitan_ext/eval/stats.py `summarize_seeds`; with one seed, the
bootstrap over documents), and each seed's figure is reported beside the pooled one; a
ratio to the reference pairs each seed's documents with the reference's (same seed when it
has one per seed, else its single run). Time per
token: wall time of a method over all documents / tokens scored, as a ratio to `truncated`
(the methods take turns on each document, so load on the machine hits them alike).
Forgetting probe: perplexity of held-out text (window-length pieces, nothing learning) under
the model before and after it memorised each document.

Shapes: a document is a list of token ids (BOS first); NLLs are (n_targets,) float64.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.grafts.lora import apply_lora, LoRAConfig, TARGETS
from models.grafts.graft import GRAFT_KINDS
from models.memory.locas import (GLU_INITS, grow_mlp_memories, init_glu_memories, LocasConfig, memory_parameters,
                                 MLP_UPDATES)
from torchtitan_ext.errors import UserError
from torchtitan_ext.eval.stats import format_summary, summarize_seeds

METHODS = ("truncated", "full", "templora", "locas_glu", "locas_mlp")


@dataclass
class Protocol:
    chunk: int = 1024
    window: int = 2048  # attention span of scoring and learning
    full_window: int = 16384  # `full`'s span
    rank: int = 64  # Locas width / TempLoRA rank
    lr: float = 4e-3  # Locas
    templora_lr: float = 1e-3
    steps: int = 1  # updates per chunk
    layers: str = "all"  # Locas' blocks
    value_scale: float = 1.0  # Locas-MLP's eps
    gradient: str = "chunk"  # Locas-MLP's G_t: the chunk's log-likelihood, or "token": log p(x_t | x_<t)
    seeds: tuple[int, ...] = (0,)  # one run per seed of the methods that draw at random

    def check(self, max_seq_len: int) -> None:
        if not 0 < self.chunk < self.window:
            raise UserError(f"--chunk {self.chunk} must be positive and smaller than --window {self.window} "
                            "(the window holds the chunk and the context before it)")
        if self.window > max_seq_len:
            raise UserError(f"--window {self.window} exceeds the model's max_seq_len {max_seq_len}")
        if self.steps < 1:
            raise UserError(f"--ttt-steps must be at least 1, got {self.steps}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise UserError(f"--seeds {','.join(map(str, self.seeds))}: give one or more distinct integers, e.g. 0,1,2")


def parse_method(spec: str) -> tuple[str, str | None]:
    """'locas_glu:topk' -> ('locas_glu', 'topk'); UserError naming the choices on anything unknown."""
    kind, _, option = spec.partition(":")
    options = {"locas_glu": GLU_INITS, "locas_mlp": MLP_UPDATES}.get(kind, ())
    if kind not in METHODS or (option and option not in options):
        raise UserError(f"--ttt method '{spec}' unknown: choose from {', '.join(METHODS)}, with locas_glu:<"
                        f"{'|'.join(GLU_INITS)}> or locas_mlp:<{'|'.join(MLP_UPDATES)}>")
    return kind, option or {"locas_glu": "topk", "locas_mlp": "bp"}.get(kind)


def is_seeded(spec: str) -> bool:
    """Whether the method draws at random (so its result depends on the seed)."""
    kind, option = parse_method(spec)
    return kind == "templora" or (kind == "locas_glu" and option in ("random_select", "gaussian"))


def chunk_nll(model: torch.nn.Module, inputs: torch.Tensor, scored: int) -> torch.Tensor:
    """NLL (scored,) of the last `scored` tokens of inputs (1, n), each given the ones before it."""
    logits = model(inputs)[0, -scored - 1 : -1]
    return F.cross_entropy(logits.float(), inputs[0, -scored:], reduction="none")


class Reader:
    """One method reading one document: a copy of `base` with what the method adds, and how
    it learns from a chunk after scoring it."""

    def __init__(self, base: torch.nn.Module, spec: str, protocol: Protocol, seed: int = 0):
        self.kind, self.option = parse_method(spec)
        self.protocol = protocol
        self.model = copy.deepcopy(base).eval()
        self.chunks_read = 0
        self.sideways, self.optimizer, params = [], None, []
        for p in self.model.parameters():
            p.requires_grad_(False)  # only what a method adds learns
        if self.kind.startswith("locas"):
            self.locas = LocasConfig(variant=self.kind.removeprefix("locas_"), rank=protocol.rank, layers=protocol.layers,
                                     **({"init": self.option} if self.kind == "locas_glu" else {"update": self.option}),
                                     value_scale=protocol.value_scale, gradient=protocol.gradient, seed=seed)
            try:
                self.sideways = GRAFT_KINDS["locas"].build(self.model, self.locas)
            except ValueError as e:
                raise UserError(f"--ttt {spec}: {e}") from None
            params = memory_parameters(self.sideways)
        elif self.kind == "templora":
            block = next(iter(self.model.layers.values()))
            targets = tuple(t for t, path in TARGETS.items() if hasattr(block.get_submodule(path.split(".")[0]), path.split(".")[1]))
            with torch.random.fork_rng(devices=[]):  # the same A init for every document and run
                torch.manual_seed(seed)
                apply_lora(list(self.model.layers.values()), LoRAConfig(rank=protocol.rank, alpha=2.0 * protocol.rank,
                                                                        dropout=0.0, targets=targets))
            self.model.eval()
            params = [p for p in self.model.parameters() if p.requires_grad]
        if params and self.kind != "locas_mlp":
            self.make_optimizer(params, protocol.templora_lr if self.kind == "templora" else protocol.lr)

    def make_optimizer(self, params, lr: float) -> None:
        self.optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)

    def extra_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def read_chunk(self, inputs: torch.Tensor, scored: int) -> torch.Tensor:
        """Score the last `scored` tokens of inputs (1, n), then learn from them -> NLL (scored,)."""
        first = self.chunks_read == 0
        self.chunks_read += 1
        if self.kind in ("truncated", "full"):
            with torch.no_grad():
                return chunk_nll(self.model, inputs, scored)
        if self.kind == "locas_glu" and first:
            with torch.no_grad():
                nll = self.recorded(inputs, scored)
            init_glu_memories(self.sideways, self.locas)
            for _ in range(self.protocol.steps):
                self.train_step(inputs, scored)
            return nll
        if self.kind == "locas_mlp" and (first or self.option == "nlsvd"):
            return self.grow(inputs, scored, first)
        nll = self.train_step(inputs, scored)
        for _ in range(self.protocol.steps - 1):
            self.train_step(inputs, scored)
        return nll

    def recorded(self, inputs: torch.Tensor, scored: int) -> torch.Tensor:
        """chunk_nll with every memory keeping its FFN input and output."""
        for s in self.sideways:
            s.recording = True
        try:
            return chunk_nll(self.model, inputs, scored)
        finally:
            for s in self.sideways:
                s.recording = False

    def grow(self, inputs: torch.Tensor, scored: int, first: bool) -> torch.Tensor:
        """Locas-MLP's expansion: a forward that records each FFN's input and output, the
        log-likelihood (the chunk's or each token's, `Protocol.gradient`) differentiated with
        respect to those outputs (the embeddings made a leaf that needs a gradient, the frozen
        weights untouched), slots grown from them."""
        hook = self.model.tok_embeddings.register_forward_hook(lambda m, i, out: out.detach().requires_grad_())
        try:
            nll = self.recorded(inputs, scored)
        finally:
            hook.remove()
        targets = slice(inputs.shape[1] - scored - 1, inputs.shape[1] - 1)
        grow_mlp_memories(self.sideways, nll, targets, self.locas, first)
        for s in self.sideways:
            s.outputs = s.inputs = None
        if self.option == "bp" and self.optimizer is None:
            self.make_optimizer(memory_parameters(self.sideways), self.protocol.lr)
        return nll.detach()

    def train_step(self, inputs: torch.Tensor, scored: int) -> torch.Tensor:
        """One AdamW step on the chunk's mean NLL (rows clipped after it for Locas-GLU) -> the
        NLL before the step (scored,)."""
        nll = chunk_nll(self.model, inputs, scored)
        nll.mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.kind == "locas_glu":
            for s in self.sideways:
                s.memory.clip_()
        return nll.detach()


def read_document(base: torch.nn.Module, spec: str, tokens: list[int], protocol: Protocol,
                  seed: int = 0) -> tuple[torch.Tensor, Reader]:
    """NLL (len(tokens) - 1,) float64 of every token after the first under `spec` (drawing
    with `seed`), chunk by chunk (each scored, then learned from), and the Reader at the end
    of the document."""
    reader = Reader(base, spec, protocol, seed)
    device = next(base.parameters()).device
    ids = torch.tensor(tokens, device=device)
    span = protocol.full_window if reader.kind == "full" else protocol.window
    parts = []
    for first_target in range(1, len(ids), protocol.chunk):
        end = min(first_target + protocol.chunk, len(ids))
        parts.append(reader.read_chunk(ids[None, max(0, end - span) : end], end - first_target).detach().double().cpu())
    return torch.cat(parts), reader


@torch.no_grad()
def probe_nll(model: torch.nn.Module, probes: list[list[int]], window: int) -> float:
    """Mean NLL per token of the probe documents, each cut into window-length pieces read alone."""
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for doc in probes:
        for start in range(0, len(doc) - 1, window):
            piece = torch.tensor(doc[start : start + window], device=device)[None]
            if piece.shape[1] < 2:
                continue
            nll = chunk_nll(model, piece, piece.shape[1] - 1)
            total, count = total + nll.sum().item(), count + nll.numel()
    return total / max(count, 1)


def check_documents(docs: list[list[int]], chunk: int) -> None:
    for i, doc in enumerate(docs):
        if len(doc) - 1 < chunk:
            raise UserError(f"document {i} has {len(doc)} tokens, fewer than one chunk ({chunk}) after the first: use "
                            "a smaller --chunk, or --min-doc-tokens to skip short documents")


def per_seed_means(nlls: list[list[torch.Tensor]], n: int) -> list[torch.Tensor]:
    """Per seed, the mean NLL (D,) of the first n scored tokens of each document with >= n."""
    return [torch.stack([d[:n].mean() for d in seed if len(d) >= n]) for seed in nlls]


def cumulative(nlls: list[list[torch.Tensor]], points: list[int]) -> list[dict]:
    """Cumulative perplexity at each N of `points` over the documents with >= N scored
    tokens; nlls: per seed, per document NLL (n_targets,). Pooled over seeds, with the
    seeds-then-documents interval and each seed's figure (`summarize_seeds`)."""
    rows = []
    for n in points:
        per_seed = per_seed_means(nlls, n)
        summary = summarize_seeds(per_seed, statistic="exp_mean")
        rows.append({"tokens": n, "documents": len(per_seed[0]), "seeds": len(per_seed), "ppl": summary["pooled"],
                     "ppl_ci95": summary["ci95"], "ppl_summary": summary, "doc_nll": [m.tolist() for m in per_seed]})
    return rows


def add_ratio(cell: dict, reference: dict) -> None:
    """Perplexity ratio of a cumulative cell to the reference's at the same N: exp of the
    mean per-document NLL difference, each seed's documents paired with the reference's
    (its same seed, or its single run), with the seeds-then-documents interval."""
    ref = reference["doc_nll"]
    diffs = [torch.tensor(d, dtype=torch.float64) - torch.tensor(ref[min(i, len(ref) - 1)], dtype=torch.float64)
             for i, d in enumerate(cell["doc_nll"])]
    summary = summarize_seeds(diffs, statistic="exp_mean")
    cell.update(ratio_to_reference=summary["pooled"], ratio_ci95=summary["ci95"], ratio_summary=summary)


def report_points(docs: list[list[int]], chunk: int) -> list[int]:
    """Every chunk boundary up to the longest document's scored length."""
    longest = max(len(d) - 1 for d in docs)
    return list(range(chunk, longest + 1, chunk)) + ([longest] if longest % chunk else [])


def run_whole_book(base: torch.nn.Module, specs: list[str], docs: list[list[int]], probes: list[list[int]],
                   protocol: Protocol) -> dict:
    """Every method over every document: cumulative perplexity, time per token, extra
    parameters, forgetting probe (see the module docstring) -> a JSON-able dict."""
    from tqdm import tqdm

    for spec in specs:
        Reader(base, spec, protocol)  # a bad method stops before any document is read
    check_documents(docs, protocol.chunk)
    points = report_points(docs, protocol.chunk)
    probe_before = probe_nll(base, probes, protocol.window) if probes else None
    runs = {spec: {"seeds": list(protocol.seeds) if is_seeded(spec) else list(protocol.seeds[:1]), "seconds": 0.0,
                   "after": [], "extra": 0} for spec in specs}
    for run in runs.values():
        run["nlls"] = [[] for _ in run["seeds"]]
    for doc in tqdm(docs, desc="documents"):
        for spec in specs:  # methods take turns on each document: machine noise hits them alike
            run = runs[spec]
            for nlls, seed in zip(run["nlls"], run["seeds"]):
                start = time.perf_counter()
                nll, reader = read_document(base, spec, doc, protocol, seed)
                run["seconds"] += time.perf_counter() - start
                nlls.append(nll)
                run["extra"] = reader.extra_parameters()
                if probes:
                    run["after"].append(probe_nll(reader.model, probes, protocol.window))
    methods = []
    for spec, run in runs.items():
        scored = sum(len(n) for seed in run["nlls"] for n in seed)
        method = {"method": spec, "seeds": run["seeds"], "extra_parameters": run["extra"], "seconds": run["seconds"],
                  "seconds_per_token": run["seconds"] / scored, "cumulative": cumulative(run["nlls"], points)}
        if probes:
            method["probe_ppl_after"] = math.exp(sum(run["after"]) / len(run["after"]))
        methods.append(method)
    reference = next((m for m in methods if m["method"] == "truncated"), methods[0])
    for m in methods:
        m["time_ratio"] = m["seconds_per_token"] / reference["seconds_per_token"]
        for cell, ref in zip(m["cumulative"], reference["cumulative"]):
            add_ratio(cell, ref)
    return {"protocol": protocol.__dict__, "documents": len(docs), "document_tokens": [len(d) for d in docs],
            "reference": reference["method"], "probe_ppl_before": math.exp(probe_before) if probes else None,
            "methods": methods}


def markdown(results: dict, picks: int = 4) -> str:
    """A table of cumulative perplexity at `picks` token counts (spread over the range), the
    ratio to the reference, time and extra parameters, and the forgetting probe."""
    points = results["methods"][0]["cumulative"]
    shown = [points[round(i * (len(points) - 1) / max(picks - 1, 1))] for i in range(min(picks, len(points)))]
    shown = list({c["tokens"]: c for c in shown}.values())
    p = results["protocol"]
    seeds = p.get("seeds", [0])
    over = "documents" if len(seeds) == 1 else (f"seeds ({', '.join(map(str, seeds))}: methods that draw at random), "
                                                "then documents; each seed's figure after the pooled one")
    lines = [f"Whole-book test-time training: {results['documents']} documents ({min(results['document_tokens'])}-"
             f"{max(results['document_tokens'])} tokens), chunk {p['chunk']}, window {p['window']}, rank {p['rank']}, "
             f"{p['steps']} step(s) per chunk; cumulative perplexity at N tokens (95% bootstrap interval over "
             f"{over}; ratio to {results['reference']} paired).", "",
             "| method | " + " | ".join(f"PPL@{c['tokens']}" for c in shown) + " | ratio@" + str(shown[-1]["tokens"])
             + " | extra params | time / token |", "| --- " * (len(shown) + 4) + "|"]
    for m in results["methods"]:
        cells = {c["tokens"]: c for c in m["cumulative"]}
        last = cells[shown[-1]["tokens"]]
        lines.append(f"| {m['method']} | " + " | ".join(format_summary(cells[c["tokens"]]["ppl_summary"], digits=2)
                                                         for c in shown)
                     + f" | {format_summary(last['ratio_summary'], digits=3)} | {m['extra_parameters']:,} | {m['time_ratio']:.2f}x |")
    if results["probe_ppl_before"] is not None:
        lines += ["", f"Forgetting probe (held-out text, nothing learning): perplexity {results['probe_ppl_before']:.2f} "
                  "before; after memorising a document (mean over documents):", ""]
        lines += [f"- {m['method']}: {m['probe_ppl_after']:.2f}" for m in results["methods"]]
    return "\n".join(lines) + "\n"


def plot(results: dict, path) -> None:
    """Cumulative perplexity (left) and its paired ratio to the reference (right) against
    tokens read, 95% bands over documents (fewer documents count as N passes their lengths)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for m in results["methods"]:
        cells = m["cumulative"]
        x = [c["tokens"] for c in cells]
        for ax, key, band in ((left, "ppl", "ppl_ci95"), (right, "ratio_to_reference", "ratio_ci95")):
            ax.plot(x, [c[key] for c in cells], label=f"{m['method']} ({m['time_ratio']:.1f}x time)")
            ax.fill_between(x, [c[band][0] for c in cells], [c[band][1] for c in cells], alpha=0.12)
    left.set(xlabel="tokens read", ylabel="cumulative perplexity", title="Whole-book test-time training")
    right.set(xlabel="tokens read", ylabel=f"perplexity / {results['reference']}'s (same documents)",
              title="Ratio to " + results["reference"])
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
