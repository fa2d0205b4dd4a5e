"""The leaderboard's cells: one (row, seed) trained through `scripts/train.sh` and evaluated in
this process, its figures written atomically to DIR/cells/<row>/seed<k>.json (a finished cell
is skipped on a rerun). Rows and suites: torchtitan_ext/eval/leaderboard_suites.py.

A cell holds: "ppl": per-document NLL (docs,) at each length of suite.ppl_lengths() and the
perplexity per position bucket (bucket = seq_len) at 8x; "ppl_past": per-document NLL of the
targets past the training length (8x documents); "recall": {task: {length: [0/1 per sample]}}
(S-NIAH, MK-NIAH, KV retrieval, BABILong qa1-qa5; a length a task's shortest sample does not
fit is absent); "cost": training tokens/s (mean of the logged steps after the first), eval
tokens/s, peak resident memory of the training process tree (bytes), state bytes carried per
sequence after reading 8x seq_len (streaming rows: the stream state's tensors; write_read rows:
the written memory's; others: None); "zero_shot": {task: [lm-eval acc per question]} of the
cell's Hugging Face export (`zero_shot_cell`; None for a test-time method, a write_read row or a
suite without the task), added to a cell finished before that column existed on the next run.

A "write_read" row (GradMem: leaderboard_suites.py's module docstring) reads each recall
prompt's context into its memory and the question after it at positions from 0 (`prompt_of`;
tasks.py `answer`), and each document in segments of its window, every segment after the
memory written from all the tokens before it (`write_read_logits`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from torchtitan_ext.errors import UserError
from torchtitan_ext.eval.leaderboard_launch import explicit_preflight
from torchtitan_ext.eval.leaderboard_suites import BABILONG_TASKS, RECALL_TASKS, Row, Suite
from torchtitan_ext.paths import write_json

REPO = Path(__file__).resolve().parents[2]


def train_env() -> dict:
    """The launcher's environment inside a suite: its checks ran once already (preflight)."""
    return {**os.environ, "SKIP_SETUP": "1", "SKIP_PREFLIGHT": "1", "WANDB_MODE": "offline", "NPROC_PER_NODE": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def launch(args: list[str], log: Path) -> int:
    """`bash scripts/train.sh ARGS` with its output in `log` and its per-rank logs and wandb
    files beside it; the peak resident bytes of its process tree (sampled every 0.2 s; for
    one process the rank alone, which train.sh starts without torchrun's agent). SystemExit
    naming the log when it fails."""
    import psutil

    env = {**train_env(), "LOG_DIR": str(log.parent / "logs"), "WANDB_DIR": str(log.parent)}
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "scripts/train.sh", *args], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        parent, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                tree = [parent, *parent.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                pass
            time.sleep(0.2)
    if proc.returncode:
        raise SystemExit(f"error: training failed (exit {proc.returncode}): see {log}")
    return peak


def config_args(config: str) -> list[str]:
    module, _, function = config.partition(":")
    return ["--module", module, "--config", function]


def train_args(row: Row, chosen: Suite, seed: int, folder: Path, hf: Path | None) -> list[str]:
    """train.sh arguments of a row's cell: suite steps and batch (the window-only control on
    window-token sequences, as many tokens per step), seed, wandb offline, the last step saved
    model-only; a graft starts from the backbone's Hugging Face folder `hf`."""
    args = [*config_args(row.config), "--training.steps", str(chosen.steps), "--debug.seed", str(seed),
            "--dump_folder", str(folder), "--validator.no-enable", "--metrics.enable-wandb", "--metrics.log_freq", "1",
            "--metrics.disable_color_printing", "--checkpoint.enable", "--checkpoint.interval", str(chosen.steps),
            "--checkpoint.last_save_model_only", "--lr_scheduler.warmup_steps", str(max(1, chosen.steps // 10))]
    if row.kind == "scratch":
        seq_len = chosen.window if row.windowed else chosen.seq_len
        batch = chosen.local_batch * chosen.seq_len // seq_len
        args += ["--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch)]
    else:
        args += ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(hf)]
    return args


def pretrain_command(out: Path, chosen: Suite) -> tuple[list[str], dict]:
    """(argv, environment) of the suite's backbone pretraining: `STEPS=<suite.backbone_steps>
    NIAH_SAMPLES=<suite.recall_samples> bash scripts/pretrain_backbone.sh out` (no STEPS: the
    script's own), in the launcher's environment; run from the checkout."""
    steps = {"STEPS": str(chosen.backbone_steps)} if chosen.backbone_steps else {}
    return ["bash", "scripts/pretrain_backbone.sh", str(out)], {**train_env(), **steps,
                                                                 "NIAH_SAMPLES": str(chosen.recall_samples)}


def backbone_folder(out: Path, chosen: Suite) -> Path:
    """The in-house backbone's Hugging Face folder out/hf (`pretrain_command`; its S-NIAH score
    inside the window in out/niah.json), made once."""
    if not (out / "hf" / "config.json").is_file():
        command, env = pretrain_command(out, chosen)
        subprocess.run(command, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    return out / "hf"


def load_row(row: Row, chosen: Suite, checkpoint: Path):
    """(long_ppl Entry, tokenizer, held-out documents) of a trained cell or the backbone folder;
    a bounded_stream row's is a "streaming" entry whose model attends to the last `window`
    tokens in every block (long_ppl's streaming with a window: `stream_window`)."""
    from torchtitan_ext.eval.long_ppl import load_entry

    bounded = row.mode == "bounded_stream"
    window = chosen.window_of(row) if row.mode in ("sliding", "write_read") or bounded else None
    entry, assets = load_entry(str(checkpoint), row.config, "streaming" if bounded else row.mode, row.name, window,
                               None)
    return entry, tokenizer_of(assets), ppl_docs(chosen, assets)


@functools.cache
def tokenizer_of(assets: str):
    from torchtitan_ext.data.tokenizer import AssetsTokenizer

    return AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=assets)


@functools.cache
def ppl_docs(chosen: Suite, assets: str) -> list[list[int]]:
    """The first suite.ppl_docs held-out embedded-corpus documents of at least 8x seq_len
    tokens, cut to that (token ids, BOS first; read once per tokenizer)."""
    from torchtitan_ext.eval.long_ppl import long_documents

    longest = chosen.ppl_lengths()[-1]
    return long_documents("embedded", tokenizer_of(assets), longest, chosen.ppl_docs, max_tokens=longest)


def ppl_figures(nll: torch.Tensor, chosen: Suite) -> dict:
    """nll (docs, 8 seq_len - 1) -> per-document NLL per length, past the training length,
    and perplexity per bucket of seq_len target positions."""
    lengths = chosen.ppl_lengths()
    buckets = [{"start": s, "ppl": math.exp(nll[:, max(0, s - 1):s - 1 + chosen.seq_len].mean().item())}
               for s in range(0, lengths[-1], chosen.seq_len)]
    return {"ppl": {str(n): nll[:, :n - 1].mean(1).tolist() for n in lengths},
            "ppl_past": nll[:, chosen.seq_len - 1:].mean(1).tolist(), "buckets": buckets}


def state_bytes(state) -> int:
    """Bytes of every tensor in a (nested) stream state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return sum(state_bytes(v) for v in vars(state).values()) if hasattr(state, "__dict__") else 0


def carried_bytes(entry, doc: list[int]) -> int | None:
    """State bytes after streaming one document (streaming rows) or of the memory written from
    it (write_read rows), else None."""
    if entry.mode == "write_read":
        with torch.no_grad():
            memory, _ = entry.model.write(torch.tensor([doc]), torch.tensor([len(doc)]))
        return state_bytes(memory)
    if entry.mode != "streaming":
        return None
    from torchtitan_ext.eval.tasks import stream_chunks

    with torch.no_grad():
        _, state = stream_chunks(entry, torch.tensor([doc]), None)
    return state_bytes(state)


def write_read_logits(entry, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (B, L, vocab) of tokens (B, L) read by a GradMem row (write_read): segments of
    entry.window tokens, each read after the memory written from every token before it (the
    first after M_0), its positions from 0; the read never sees the context itself."""
    model, logits = entry.model, []
    batch, length = tokens.shape
    for start in range(0, length, entry.window):
        if start:
            memory, _ = model.write(tokens[:, :start], torch.full((batch,), start))
        else:
            memory = model.gradmem.initial(batch)
        with torch.no_grad():
            logits.append(model.read(memory, tokens[:, start:start + entry.window]))
    return torch.cat(logits, 1)


def document_nll(entry, tokens: torch.Tensor) -> torch.Tensor:
    """(B, L - 1) NLL of tokens[:, 1:] under the row's mode (long_ppl's `token_nll`, or
    `write_read_logits`)."""
    from torchtitan_ext.eval.long_ppl import token_nll

    if entry.mode != "write_read":
        return token_nll(entry, tokens)
    logits = write_read_logits(entry, tokens)
    return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).float(), tokens[:, 1:], reduction="none")


def visible(entry, ids: list[int]) -> list[int]:
    """The prompt a row reads: a sliding-window row sees its last `window` tokens."""
    return ids[-entry.window:] if entry.mode == "sliding" else ids


def prompt_of(entry, tokenizer, task: str, sample, ids: list[int]) -> tuple[list[int], int]:
    """(prompt ids, the question's first index) a row reads of a sample whose BOS + context +
    query encodes as `ids`: a write_read row gets BOS + context and the question encoded apart,
    the question a new segment at the context's length (tasks.py `encode_prompt` /
    babilong.py `encode`, "new_segment"); the others `visible(ids)`, the question right after
    the context (index 0)."""
    from torchtitan_ext.eval import babilong
    from torchtitan_ext.eval.tasks import encode_prompt

    if entry.mode != "write_read":
        return visible(entry, ids), 0
    if task in BABILONG_TASKS:
        return babilong.encode(sample, ids, tokenizer, "new_segment")
    prompt, query, _, _ = encode_prompt(task, sample, ids, tokenizer, "new_segment")
    return prompt, query


def task_scores(entry, tokenizer, chosen: Suite, task: str, length: int, learned=None) -> list[float]:
    """Exact match (0/1) of each prompt of a task at one length, drawn the same for every row
    and seed (random.Random(f"{task}-{length}")), placed as the row reads it (`prompt_of`);
    [] when the task's shortest sample does not fit the length. `learned` (a test-time row):
    (the whole prompt's ids) -> the entry that answers it, a copy of `entry`'s model that has
    learned from the prompt (`evaluate_test_time`)."""
    from torchtitan_ext.data.synthetic_tasks import fit_sample, score
    from torchtitan_ext.eval import babilong
    from torchtitan_ext.eval.tasks import answer

    def generate(ids: list[int], sample) -> str:
        prompt, query = prompt_of(entry, tokenizer, task, sample, ids)
        return tokenizer.decode(answer(learned(ids) if learned else entry, prompt, chosen.answer_tokens, query))

    try:
        if task in BABILONG_TASKS:
            drawn = babilong.items([task], [str(length)], chosen.recall_samples, 0, tokenizer)[task, str(length)]
            return [float(babilong.correct(generate(ids, item), item.answers[0])) for ids, item in drawn]
        rng = random.Random(f"{task}-{length}")
        drawn = [fit_sample(task, rng, tokenizer, length) for _ in range(chosen.recall_samples)]
    except UserError:
        return []
    return [float(score(task, generate(ids, sample), sample.answers) == 1.0) for ids, sample in drawn]


def recall(entry, tokenizer, chosen: Suite, row: Row, learned=None) -> dict:
    """{task: {length: [0/1 per prompt]}} at 1x-8x the row's window: S-NIAH, MK-NIAH, KV
    retrieval, BABILong qa1-qa5; greedy decoding, the question right after the context (a
    write_read row: after the memory the context was written into; a test-time row: by its
    model once it has learned from the prompt, `learned`)."""
    out: dict = {}
    for task in (*RECALL_TASKS, *BABILONG_TASKS):
        for length in chosen.recall_lengths(row):
            if scores := task_scores(entry, tokenizer, chosen, task, length, learned):
                out.setdefault(task, {})[str(length)] = scores
    return out


def evaluate_model(row: Row, chosen: Suite, checkpoint: Path) -> dict:
    """Perplexity, recall and eval cost of one trained row (module docstring)."""
    entry, tokenizer, docs = load_row(row, chosen, checkpoint)
    start = time.perf_counter()
    with torch.no_grad():
        nll = torch.cat([document_nll(entry, torch.tensor([d])) for d in docs]).float()
    seconds = time.perf_counter() - start
    return {**ppl_figures(nll, chosen), "recall": recall(entry, tokenizer, chosen, row),
            "cost": {"eval_tokens_per_s": nll.numel() / seconds, "state_bytes": carried_bytes(entry, docs[0])}}


def evaluate_test_time(row: Row, chosen: Suite, hf: Path, seed: int) -> dict:
    """Perplexity, recall and eval cost of a whole_book.py method on the frozen backbone:
    documents read in chunks of half a window inside a window, each scored before it is
    learned from; a recall prompt read so, whole (its question too), then answered by the model
    that learned from it, through its sliding window as the backbone reads (`visible`)."""
    from torchtitan_ext.eval.whole_book import Protocol, read_document

    entry, tokenizer, docs = load_row(row, chosen, hf)
    window = chosen.window_of(row)
    protocol = Protocol(chunk=window // 2, window=window, rank=8, seeds=(seed,))
    start = time.perf_counter()
    nll = torch.stack([read_document(entry.model, row.method, d, protocol, seed)[0] for d in docs]).float()
    seconds = time.perf_counter() - start

    def learned(ids: list[int]):
        return dataclasses.replace(entry, model=read_document(entry.model, row.method, ids, protocol, seed)[1].model)

    return {**ppl_figures(nll, chosen), "recall": recall(entry, tokenizer, chosen, row, learned),
            "cost": {"eval_tokens_per_s": nll.numel() / seconds, "state_bytes": None}}


def training_cost(log: Path, peak: int) -> dict:
    """Training tokens/s (mean over the logged steps after the first) and peak bytes."""
    from torchtitan_ext.training.run_log import parse_steps

    steps = parse_steps(log.read_text())
    later = [v["tps"] for s, v in sorted(steps.items())[1:] if "tps" in v and math.isfinite(v["tps"])]
    return {"train_tokens_per_s": sum(later) / len(later) if later else None, "peak_rss_bytes": peak}


def train_cell(row: Row, chosen: Suite, seed: int, out: Path, hf: Path | None) -> dict | None:
    """Train one cell of a row that trains (scratch, graft): its training cost (kept in the run
    folder's train_cost.json, so a run whose evaluation was cut short is not trained again);
    else None."""
    if row.kind not in ("scratch", "graft"):
        return None
    folder = cell_folder(out, row, seed)
    if not (folder / "train_cost.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        peak = launch(train_args(row, chosen, seed, folder, hf), folder / "train.log")
        write_json(folder / "train_cost.json", training_cost(folder / "train.log", peak))
    return json.loads((folder / "train_cost.json").read_text())


def evaluate_cell(row: Row, chosen: Suite, seed: int, out: Path, hf: Path | None) -> dict:
    """The figures of one cell: its trained checkpoint, the backbone, or a test-time method."""
    torch.manual_seed(seed)
    if row.kind == "test_time":
        return evaluate_test_time(row, chosen, hf, seed)
    checkpoint = hf if row.kind == "backbone" else cell_folder(out, row, seed) / "checkpoint" / f"step-{chosen.steps}"
    return evaluate_model(row, chosen, checkpoint)


def export_folder(row: Row, chosen: Suite, seed: int, out: Path, hf: Path | None) -> Path:
    """The Hugging Face folder of a trained cell that lm-eval reads: the backbone's own (the
    frozen backbone), else the cell's last checkpoint exported once into its run folder's
    hf_<row>/ (plain transformers classes or the project's remote code, which transformers
    caches per process under the folder's name, so each row's export has its own)."""
    if row.kind == "backbone":
        return hf
    folder = cell_folder(out, row, seed) / f"hf_{row.name}"
    if not (folder / "config.json").is_file():
        from torchtitan_ext.hf_export import export
        from torchtitan_ext.training.checkpoints import model_from_checkpoint

        module, _, function = row.config.partition(":")
        model, config = model_from_checkpoint(module, function,
                                              cell_folder(out, row, seed) / "checkpoint" / f"step-{chosen.steps}")
        export(model, config, folder)
    return folder


def zero_shot_available(chosen: Suite) -> bool:
    """Whether this run scores the suite's zero-shot column: it has the task and lm_eval is
    installed (else one warning line naming the fix; the cells get no zero-shot entry, which a
    later run with lm_eval fills in)."""
    import importlib.util

    if not chosen.zero_shot_items:
        return False
    if importlib.util.find_spec("lm_eval") is None:
        print("warning: zero-shot column skipped: lm_eval is not installed (EXTRAS=eval bash scripts/setup.sh); "
              "a later run fills it in", file=sys.stderr)
        return False
    return True


def zero_shot_cell(row: Row, chosen: Suite, seed: int, out: Path, hf: Path | None) -> dict | None:
    """{task: [lm-eval acc of each question, by doc id]} of a cell's export on the suite's
    local zero-shot task (torchtitan_ext/eval/zero_shot.py: heldout_cloze, `zero_shot_items`
    questions written once into out/zero_shot_task), float32; None for a test-time method and
    a write_read row (GradMem reads only from a memory its
    context was written into, and lm-eval scores a causal forward of context + ending), and a
    bounded_stream row (lm-eval's causal forward does not stream: its figure is the row's
    whose model it reads)."""
    from torchtitan_ext.eval.zero_shot import CLOZE_TASK, run_lm_eval, write_cloze_task

    if row.mode in ("write_read", "bounded_stream") or row.kind == "test_time":
        return None
    folder = export_folder(row, chosen, seed, out, hf)
    tasks = out / "zero_shot_task"
    if not (tasks / f"{CLOZE_TASK}.yaml").is_file():
        write_cloze_task(tasks, chosen.zero_shot_items)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scores = run_lm_eval(folder, CLOZE_TASK, str(tasks), device, "float32", None)
    return {CLOZE_TASK: [scores[(CLOZE_TASK, i)] for i in range(chosen.zero_shot_items)]}


def cell_folder(out: Path, row: Row, seed: int) -> Path:
    """The training run's dump folder of a cell (shared with the row it reads the runs of)."""
    return out / "runs" / row.runs_name / f"seed{seed}"


def cell_path(out: Path, row: Row, seed: int) -> Path:
    return out / "cells" / row.name / f"seed{seed}.json"


def run_cells(rows: tuple[Row, ...], chosen: Suite, out: Path) -> dict:
    """Every unfinished (row, seed) cell run and written, seed by seed, with a progress bar over cells: the
    training runs one after another in a thread, each cell evaluated here once its run ends;
    with suite.overlap the next cell trains during an evaluation (faster; the cost figures
    then share the CPU). {"run": n, "skipped": n}."""
    from tqdm import tqdm

    # seed-major: a run stopped part-way has every row at its first seeds (each hypothesis
    # answered on fewer seeds) rather than some rows with all seeds and others with none
    cells = [(row, seed) for seed in chosen.seeds for row in rows]
    pending = [(row, seed) for row, seed in cells if not cell_path(out, row, seed).is_file()]
    zero_shot = zero_shot_available(chosen)
    no_zero_shot = [(row, seed) for row, seed in cells if zero_shot and (row, seed) not in pending
                    and "zero_shot" not in json.loads(cell_path(out, row, seed).read_text())]
    needs_backbone = any(row.kind != "scratch" for row, _ in pending + no_zero_shot)
    hf = backbone_folder(out / "backbone", chosen) if needs_backbone else None
    first = {row.name: (row, seed) for row, seed in reversed(pending) if row.kind in ("scratch", "graft")}
    for row, seed in first.values():
        explicit_preflight(train_args(row, chosen, seed, cell_folder(out, row, seed), hf))
    for row, seed in no_zero_shot:  # a cell finished before the zero-shot column existed
        cell = json.loads(cell_path(out, row, seed).read_text())
        write_json(cell_path(out, row, seed), {**cell, "zero_shot": zero_shot_cell(row, chosen, seed, out, hf)})
    threads = torch.get_num_threads()
    if chosen.overlap:  # the evaluations take as many threads as the training beside them (train_env)
        torch.set_num_threads(int(train_env()["OMP_NUM_THREADS"]))
    lead, trainer, trained = int(chosen.overlap), ThreadPoolExecutor(max_workers=1), []
    try:
        for index, (row, seed) in enumerate(tqdm(pending, desc="cells", file=sys.stderr)):
            while len(trained) <= min(index + lead, len(pending) - 1):  # with overlap the next run trains meanwhile
                queued_row, queued_seed = pending[len(trained)]
                trained.append(trainer.submit(train_cell, queued_row, chosen, queued_seed, out, hf))
            cost = trained[index].result()
            started = time.time()
            result = evaluate_cell(row, chosen, seed, out, hf)
            if zero_shot:
                result["zero_shot"] = zero_shot_cell(row, chosen, seed, out, hf)
            write_json(cell_path(out, row, seed), {"row": row.name, "seed": seed, "mode": row.mode, "window": chosen.window_of(row),
                                                   "eval_seconds": time.time() - started, **result, "train": cost})
    finally:
        trainer.shutdown(cancel_futures=True)
        torch.set_num_threads(threads)
    return {"run": len(pending), "skipped": len(cells) - len(pending)}
