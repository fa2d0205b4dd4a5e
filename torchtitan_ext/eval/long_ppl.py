"""Long-context perplexity: NLL per token against context length, for one or more checkpoints
(`scripts/eval_long_ppl.py` runs it; its flags are named here).

Documents at least as long as the context are read from their start (never concatenated
across documents); for each context length L, each one's first L tokens are scored: the NLL
of every token after the first, given the ones before it. Reported: perplexity per context
length (with a 95% bootstrap interval over documents; with several checkpoints, each one's
perplexity ratio to the first on the same documents, with a paired interval), and per
position bucket (`--bucket` tokens) so the fall (or rise) along the
context is visible.

Modes (one per checkpoint, or one for all):
- full: the whole context in one forward pass;
- streaming: memory models (Mela, Titans): segments of `--segment` tokens (default: one Mela
  chunk, or 64 tokens / one MAC window for Titans), the
  memory state carried between them, so memory use stays constant in L; the pretrained
  backbone and its grafts stream too, carrying their key / value caches (memory grows with L),
  or with `--window` W every block's attention bounded to the last W tokens (sliding-window
  attention, caches cut: `DecoderLM.stream`'s `stream_window`; other models keep their own window);
- truncated: independent blocks of `--window` tokens (default: the training seq_len), the
  context reset at each block start (a Transformer++ baseline);
- sliding: each token sees up to `--window` earlier tokens (windows advance by half a window).

Datasets: `embedded` (held-out split of the embedded corpus), `fineweb_edu` (its held-out
split, streamed), `pg19` (`deepmind/pg19` test split, streamed), `kjv` (the King James
Bible's 66 books from Debian's bible-kjv, offline), `locomo:<locomo10.json>` (each LoCoMo
conversation's dialogue; torchtitan_ext/data/locas_data.py), or a local
.txt/.jsonl/.parquet file or folder: its held-out split (the documents training's
`local` dataset never reads: the same hash split as its validation), or with `--split all`
every document (for a file held out by hand). The results state which.

Checkpoints: a DCP step folder, or a Hugging Face export folder (`scripts/convert_to_hf.py`;
recognised by its config.json), with the `--config` it was trained with. `--device` (default
cuda when present) and `--dtype` (default bfloat16 on cuda, float32 on cpu) place the model;
the memories' fast-weight state stays float32 either way.

Whole-book test-time training (`--ttt METHOD[,METHOD...]`, one checkpoint; the Locas paper's
PG-19 protocol, torchtitan_ext/eval/whole_book.py): every document read chunk by chunk (`--chunk`, default
half of `--window`) in a bounded window, each chunk scored before the method learns from it,
methods truncated, full, templora, locas_glu[:init], locas_mlp[:bp|nlsvd]; reports cumulative
perplexity against tokens read, time per token, extra parameters and a forgetting probe
(`--probe-docs` held-out documents of `--probe-dataset`), in results.json, results.md and
cumulative_ppl.png. A document shorter than one chunk stops the run (`--min-doc-tokens` skips
short ones, `--max-doc-tokens` cuts long ones); `--dataset pg19` streams PG-19's test split
from the Hub. `--seeds 0,1,2` reads the documents once per seed with the methods that draw at
random (TempLoRA, Locas-GLU's random_select / gaussian); intervals resample seeds, then
documents. `--locas-gradient token` grows Locas-MLP from the paper's per-token gradient.

Bad input (a checkpoint of another family or size, a missing tokenizer, a context the model
cannot take in the chosen mode, no document long enough) raises UserError.

Shapes: a document is a list of token ids (BOS first); tokens (B, L), logits (B, L, vocab),
NLLs (B, L - 1).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from torchtitan_ext.training.checkpoints import causal_logits, model_from_checkpoint
from torchtitan_ext.errors import UserError
from torchtitan_ext.eval.stats import bootstrap
from torchtitan_ext.eval.whole_book import parse_method, Protocol, read_document, run_whole_book
from torchtitan_ext.hf_export import import_weights

MODES = ("full", "streaming", "truncated", "sliding")


@dataclass
class Entry:
    """One checkpoint to evaluate: its model (eval mode), how to run it, how to name it."""

    label: str
    model: torch.nn.Module
    mode: str
    window: int  # training seq_len: the truncated / sliding span
    segment: int  # streaming segment length
    max_seq_len: int


def load_entry(checkpoint: str, config: str, mode: str, label: str | None, window: int | None,
               segment: int | None, device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[Entry, str]:
    """(Entry, tokenizer folder) for a DCP step folder or Hugging Face export trained with
    `module:function`, its model on `device` in `dtype`."""
    module, _, function = config.partition(":")
    if not function:
        raise UserError(f"--config '{config}' must be <module>:<function>, e.g. train_configs.mela:mela_debug")
    if (Path(checkpoint) / "config.json").is_file():
        model, trainer_config = import_weights(module, function, Path(checkpoint))
    else:
        model, trainer_config = model_from_checkpoint(module, function, checkpoint)
    model = model.to(device, dtype)
    if mode == "streaming":
        if not hasattr(model, "stream"):
            raise UserError(f"{function} has no memory state to stream: use --mode full, truncated or sliding")
        unit = model.cfg.stream_segment
        segment = segment or max(unit, 64)
        if segment % unit:
            raise UserError(f"--segment {segment} must be a multiple of {function}'s stream segment of {unit} tokens")
        if window and hasattr(model.cfg, "stream_window"):  # a backbone or graft: its attention bounded
            if segment > window:
                raise UserError(f"--segment {segment} exceeds --window {window}: a bounded stream reads at most "
                                "--window tokens per call")
            model.cfg.stream_window = window
    entry = Entry(label or function, model, mode, window or trainer_config.training.seq_len, segment or 0,
                  trainer_config.model_spec.model.max_seq_len)
    return entry, trainer_config.hf_assets_path


def check_context(entry: Entry, length: int) -> None:
    if entry.mode in ("full", "streaming") and length > entry.max_seq_len:
        raise UserError(f"{entry.label} takes at most {entry.max_seq_len} tokens in one pass ({entry.mode} mode), "
                        f"asked {length}: use --mode truncated or sliding, or shorter --context-lengths")


def documents(dataset: str, split: str = "heldout"):
    """Iterate the dataset's texts (see the module docstring); `split` applies to local data."""
    from torchtitan_ext.data import datasets

    if dataset == "embedded":
        yield from datasets.load_embedded("", validation=True)["text"]
    elif dataset == "fineweb_edu":
        yield from (s["text"] for s in datasets.load_fineweb_edu(datasets.FINEWEB_EDU_REPO, validation=True))
    elif dataset == "pg19":
        from datasets import load_dataset

        yield from (s["text"] for s in load_dataset("deepmind/pg19", split="test", streaming=True))
    elif dataset == "kjv":
        from torchtitan_ext.data.locas_data import kjv_books

        yield from kjv_books()
    elif dataset.startswith("locomo:"):
        from torchtitan_ext.data.locas_data import load_locomo

        yield from (c.text() for c in load_locomo(dataset.removeprefix("locomo:")))
    else:
        held_out = split == "heldout"
        yield from datasets.load_local(dataset, validation=held_out, **({} if held_out else {"per_mille": 0}))["text"]


def long_documents(dataset: str, tokenizer, min_tokens: int, max_docs: int, split: str = "heldout",
                   max_tokens: int | None = None) -> list[list[int]]:
    """Token ids (BOS first) of the first `max_docs` documents of at least `min_tokens` tokens,
    each cut to its first `max_tokens` (when given)."""
    from tqdm import tqdm

    found = []
    with tqdm(desc=f"documents >= {min_tokens} tokens", total=max_docs, file=sys.stderr) as bar:
        for text in documents(dataset, split):
            ids = tokenizer.encode(text, add_bos=True, add_eos=False)
            if len(ids) >= min_tokens:
                found.append(ids[:max_tokens])
                bar.update()
                if len(found) == max_docs:
                    break
    return found


def entry_logits(entry: Entry, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (B, L, vocab) of tokens (B, L) read in the entry's mode: one pass, or
    segment by segment with the memory state carried (streaming)."""
    if entry.mode != "streaming":
        return causal_logits(entry.model, tokens)
    logits, state = [], None
    for start in range(0, tokens.shape[1], entry.segment):
        out, state = entry.model.stream(tokens[:, start : start + entry.segment], state)
        logits.append(out)
    return torch.cat(logits, 1)


def window_nll(entry: Entry, tokens: torch.Tensor) -> torch.Tensor:
    """NLL of tokens[:, 1:] given their prefix inside `tokens` alone: (B, L - 1)."""
    logits = entry_logits(entry, tokens)
    return F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), tokens[:, 1:], reduction="none")


def token_nll(entry: Entry, tokens: torch.Tensor) -> torch.Tensor:
    """(B, L - 1) NLL of tokens[:, 1:] under the entry's mode."""
    length, window = tokens.shape[1], entry.window
    if entry.mode in ("full", "streaming") or length <= window:
        return window_nll(entry, tokens)
    if entry.mode == "truncated":
        # Blocks of `window` tokens overlapping by one: each scores its window - 1 last
        # tokens from the block alone (the context restarts at every block).
        starts = range(0, length - 1, window - 1)
        return torch.cat([window_nll(entry, tokens[:, s : s + window]) for s in starts], 1)
    stride = max(1, window // 2)
    parts, next_target = [window_nll(entry, tokens[:, :window])], window
    while next_target < length:
        end = min(next_target + stride, length)
        parts.append(window_nll(entry, tokens[:, end - window : end])[:, next_target - end :])
        next_target = end
    return torch.cat(parts, 1)


def evaluate(entry: Entry, docs: list[list[int]], length: int, bucket: int, batch: int) -> dict:
    """Perplexity over the first `length` tokens of each document, overall and per bucket of
    target positions [k * bucket, (k + 1) * bucket)."""
    from tqdm import tqdm

    check_context(entry, length)
    rows = torch.tensor([d[:length] for d in docs], device=next(entry.model.parameters()).device)
    with torch.no_grad():
        nll = torch.cat([token_nll(entry, rows[i : i + batch]).float().cpu() for i in
                         tqdm(range(0, len(rows), batch), desc=f"{entry.label} @ {length}", file=sys.stderr)])
    positions = torch.arange(1, length)
    per_doc = nll.mean(1).double()
    buckets = []
    for start in range(0, length, bucket):
        inside = (positions >= start) & (positions < start + bucket)
        buckets.append({"start": start, "end": min(start + bucket, length), "ppl": math.exp(nll[:, inside].mean().item())})
    return {"ppl": math.exp(nll.mean().item()), "ppl_ci95": list(bootstrap(per_doc)), "nll": nll.mean().item(),
            "doc_nll": per_doc.tolist(), "tokens": nll.numel(), "documents": len(rows), "buckets": buckets}


def add_paired_ratio(cell: dict, reference: dict) -> None:
    """Perplexity ratio to the first run on the same documents, exp(mean per-document NLL
    difference), with its 95% bootstrap interval (paired: tighter than the two intervals)."""
    diff = torch.tensor(cell["doc_nll"], dtype=torch.float64) - torch.tensor(reference["doc_nll"], dtype=torch.float64)
    cell["ratio_to_first"] = math.exp(diff.mean().item())
    cell["ratio_to_first_ci95"] = list(bootstrap(diff))


def markdown(results: dict) -> str:
    lengths = results["context_lengths"]
    lines = [f"Perplexity on `{Path(results['dataset']).name}`, {results.get('split', 'held-out split')} (documents of at "
             f"least the context length, first L tokens; {results.get('device', 'cpu')}, "
             f"{results.get('dtype', 'float32')}; 95% bootstrap interval over documents).", "",
             "| model | mode | " + " | ".join(str(n) for n in lengths) + " |",
             "| --- | --- | " + " | ".join("---" for _ in lengths) + " |"]
    for run in results["runs"]:
        cells = [f"{r['ppl']:.2f} ({r['ppl_ci95'][0]:.2f}-{r['ppl_ci95'][1]:.2f})"
                 for r in (run["results"][str(n)] for n in lengths)]
        lines.append(f"| {run['label']} | {run['mode']} | " + " | ".join(cells) + " |")
    if len(results["runs"]) > 1:
        first = results["runs"][0]["label"]
        lines += ["", f"Perplexity ratio to {first} on the same documents (paired 95% bootstrap interval):", "",
                  "| model | " + " | ".join(str(n) for n in lengths) + " |", "| --- | " + " | ".join("---" for _ in lengths) + " |"]
        for run in results["runs"][1:]:
            cells = [f"{r['ratio_to_first']:.3f} ({r['ratio_to_first_ci95'][0]:.3f}-{r['ratio_to_first_ci95'][1]:.3f})"
                     for r in (run["results"][str(n)] for n in lengths)]
            lines.append(f"| {run['label']} | " + " | ".join(cells) + " |")
    longest = str(lengths[-1])
    lines += ["", f"Per position bucket at {longest} tokens:", "",
              "| model | " + " | ".join(f"{b['start']}-{b['end']}" for b in results["runs"][0]["results"][longest]["buckets"]) + " |",
              "| --- | " + " | ".join("---" for _ in results["runs"][0]["results"][longest]["buckets"]) + " |"]
    for run in results["runs"]:
        lines.append(f"| {run['label']} | " + " | ".join(f"{b['ppl']:.2f}" for b in run["results"][longest]["buckets"]) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullLocator, ScalarFormatter

    fig, ax = plt.subplots(figsize=(6, 4))
    lengths = results["context_lengths"]
    for run in results["runs"]:
        ax.plot(lengths, [run["results"][str(n)]["ppl"] for n in lengths], marker="o", label=f"{run['label']} ({run['mode']})")
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="perplexity",
           title=f"Perplexity vs context ({Path(results['dataset']).name})")
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_locator(NullLocator())
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def per_checkpoint(values: list | None, count: int, name: str, default=None) -> list:
    """One value per checkpoint: the one given (or `default`) repeated, or one each; UserError otherwise."""
    values = values or [default]
    if len(values) == 1:
        return values * count
    if len(values) != count:
        raise UserError(f"{len(values)} {name} values for {count} checkpoints: give one, or one per --checkpoint")
    return values


def run_ttt(args: argparse.Namespace) -> dict:
    """The whole-book protocol (`--ttt`) on the one checkpoint."""
    from torchtitan_ext.data.tokenizer import AssetsTokenizer

    if len(args.checkpoint) != 1:
        raise UserError(f"--ttt reads one checkpoint, got {len(args.checkpoint)}: compare methods of one model per run")
    specs = args.ttt.split(",")
    for spec in specs:
        parse_method(spec)
    entry, tokenizer_dir = load_entry(args.checkpoint[0], args.config[0], "full", None, args.window, None,
                                      args.device, args.dtype)
    window = entry.window
    protocol = Protocol(chunk=args.chunk or window // 2, window=window, full_window=args.full_window or entry.max_seq_len,
                        rank=args.ttt_rank, lr=args.ttt_lr, templora_lr=args.templora_lr, steps=args.ttt_steps,
                        layers=args.locas_layers, value_scale=args.value_scale,
                        gradient=args.locas_gradient, seeds=parse_seeds(args.seeds))
    protocol.check(entry.max_seq_len)
    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=tokenizer_dir)
    docs = long_documents(args.dataset, tokenizer, args.min_doc_tokens, args.max_docs, args.split, args.max_doc_tokens)
    if not docs:
        raise UserError(f"no document of at least {args.min_doc_tokens} tokens in '{args.dataset}'")
    probes = long_documents(args.probe_dataset, tokenizer, 2, args.probe_docs) if args.probe_docs else []
    results = run_whole_book(entry.model, specs, docs, probes, protocol)
    if args.merge_out:
        export_merged(entry.model, specs, docs[-1], protocol, args.config[0], args.merge_out)
    return {"dataset": args.dataset, "split": dataset_split(args.dataset, args.split), "device": args.device,
            "dtype": str(args.dtype).removeprefix("torch."), "checkpoint": args.checkpoint[0], **results}


def parse_seeds(text: str) -> tuple[int, ...]:
    """'0,1,2' -> (0, 1, 2); UserError on anything else."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"--seeds '{text}' must be comma-separated integers, e.g. 0,1,2") from None


def export_merged(base: torch.nn.Module, specs: list[str], document: list[int], protocol, config: str, out: Path) -> None:
    """The first Locas method's model after reading `document`, its memories merged into the
    FFNs (models/memory/locas.py `merge_locas`), written as a Hugging Face folder: a plain
    LlamaForCausalLM / Qwen3ForCausalLM for the backbone, the family's export otherwise."""
    from models.memory.locas import merge_locas
    from torchtitan_ext.training.checkpoints import build_model
    from torchtitan_ext.hf_export import export

    locas = [s for s in specs if s.startswith("locas")]
    if not locas:
        raise UserError("--merge-out needs a Locas method in --ttt (locas_glu or locas_mlp)")
    module, _, function = config.partition(":")
    _, trainer_config = build_model(module, function, "meta")
    _, reader = read_document(base, locas[0], document, protocol)
    export(merge_locas(reader.model), trainer_config, out)


def run(args: argparse.Namespace) -> dict:
    """Perplexity of every --checkpoint at every --context-lengths on the same documents (the
    module docstring) -> a JSON-able dict."""
    from torchtitan_ext.data.tokenizer import AssetsTokenizer

    count = len(args.checkpoint)
    configs = per_checkpoint(args.config, count, "--config")
    modes = per_checkpoint(args.mode, count, "--mode", "full")
    labels = per_checkpoint(args.label, count, "--label")
    lengths = sorted(int(n) for n in args.context_lengths.split(","))
    entries, tokenizer_dirs = zip(*(load_entry(c, cfg, m, lab, args.window, args.segment, args.device, args.dtype)
                                    for c, cfg, m, lab in zip(args.checkpoint, configs, modes, labels)))
    if len(set(tokenizer_dirs)) > 1:
        raise UserError(f"the checkpoints use different tokenizers ({sorted(set(tokenizer_dirs))}): evaluate them separately")
    for entry in entries:
        for length in lengths:
            check_context(entry, length)
    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=tokenizer_dirs[0])
    docs = long_documents(args.dataset, tokenizer, lengths[-1], args.max_docs, args.split)
    if not docs:
        raise UserError(f"no document of at least {lengths[-1]} tokens in '{args.dataset}': use shorter "
                        "--context-lengths or a dataset of longer documents")
    runs = [{"label": e.label, "checkpoint": str(c), "mode": e.mode,
             "results": {str(n): evaluate(e, docs, n, args.bucket, args.batch_size) for n in lengths}}
            for e, c in zip(entries, args.checkpoint)]
    for other in runs[1:]:
        for n in lengths:
            add_paired_ratio(other["results"][str(n)], runs[0]["results"][str(n)])
    return {"dataset": args.dataset, "split": dataset_split(args.dataset, args.split), "device": args.device,
            "dtype": str(args.dtype).removeprefix("torch."), "context_lengths": lengths, "documents": len(docs),
            "runs": runs}


def dataset_split(dataset: str, split: str) -> str:
    """Which documents of `dataset` were scored, in words (written into the results)."""
    if dataset in ("embedded", "fineweb_edu"):
        return "held-out split (never read by training)"
    if dataset == "pg19":
        return "test split"
    if dataset == "kjv":
        return "every book of the King James Bible (Debian's bible-kjv; no model here trained on it)"
    if dataset.startswith("locomo:"):
        return "every LoCoMo conversation's dialogue"
    return "held-out split (never read by training)" if split == "heldout" else "every document (--split all)"
