"""The Titans memory stress sweep (issue 46): does every variant train finite at the memory's
defaults, wherever a user might train it?

Each cell trains one Titans variant from scratch on MQAR (Zoology's query distribution,
`mqar.batch`; 8 key-value pairs, vocabulary 256) in a plain loop: AdamW (0.9, 0.999), weight
decay 0.1, gradient clip 1.0, a linear warmup over 10% of the steps, then the peak lr held (no
decay: harsher than a cosine; `cosine_steps` N gives the issue's schedule instead: 5% of N warmup,
then a cosine to 0 over N). The model is `mqar.build_model`'s (the project's init), 2
layers of 2 heads, window = MAC segment = T / 4, memory chunk C; every other memory option at
its default. A cell is non-finite at the first step whose loss, a parameter, or a memory's
fast-weight norm at the end of the forward is not finite (that step's `nonfinite_step`); it
is never dropped. `memory` overrides fields of the memory (e.g. `max_update_norm=0.0`, the
unbounded memory the issue reported), and is part of the cell's key.

The grid: variants LMM, MAC, MAG, MAL x widths 64, 128 x lr 1e-3, 3e-3, 1e-2 x T 64, 128, 256
x C 8, 16, 64 (216 cells), each at one seed of 0-4 (the cell's index mod 5, so every seed
meets every factor level). Per cell it records the first non-finite step, the last loss,
the largest fast-weight norm, how many steps clipped a surprise sum and the largest share
clipped in a forward (`NeuralMemory.last_stats`), and the wall time. `run` appends one JSON
line per cell to a file and skips the cells it already holds (resumable);
`summary` makes the markdown table of docs/benchmarks.md from its records.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchtitan_ext.eval import mqar
from torchtitan_ext.eval.jsonl import read_records

VARIANTS = ("lmm", "mac", "mag", "mal")
WIDTHS = (64, 128)
LRS = (1e-3, 3e-3, 1e-2)
SEQ_LENS = (64, 128, 256)
CHUNKS = (8, 16, 64)
SEEDS = 5


@dataclass(frozen=True)
class Cell:
    """One training run of the sweep (module docstring)."""

    variant: str
    width: int
    lr: float
    seq_len: int
    chunk: int
    seed: int
    steps: int = 120
    batch_size: int = 16
    memory: tuple[tuple[str, float], ...] = ()  # memory config overrides, as (field, value) pairs
    cosine_steps: int = 0  # 0: the peak lr held after the warmup; N: 5% warmup of N, then a cosine to 0 over N

    def key(self) -> str:
        options = "".join(f" {name}={value:g}" for name, value in self.memory)
        schedule = f" cosine{self.cosine_steps}" if self.cosine_steps else ""
        return (f"{self.variant} w{self.width} lr{self.lr:g} T{self.seq_len} C{self.chunk} seed{self.seed} "
                f"steps{self.steps} b{self.batch_size}{schedule}{options}")


def grid(steps: int = 120, batch_size: int = 16, memory: dict | None = None, variants=VARIANTS, widths=WIDTHS,
         lrs=LRS, seq_lens=SEQ_LENS, chunks=CHUNKS, cosine_steps: int = 0) -> list[Cell]:
    """Every (variant, width, lr, T, C) of the given levels, the seed cycling over 0-4."""
    overrides = tuple(sorted((memory or {}).items()))
    levels = itertools.product(variants, widths, lrs, seq_lens, chunks)
    return [Cell(v, w, lr, t, c, i % SEEDS, steps, batch_size, overrides, cosine_steps)
            for i, (v, w, lr, t, c) in enumerate(levels)]


def build(cell: Cell) -> torch.nn.Module:
    from models.memory.neural_memory import NeuralMemoryConfig

    torch.manual_seed(cell.seed)
    return mqar.build_model(f"titans_{cell.variant}", dim=cell.width, n_layers=2, n_heads=2, window=cell.seq_len // 4,
                            vocab_size=256, memory=NeuralMemoryConfig(chunk_size=cell.chunk, **dict(cell.memory)))


@dataclass
class Watch:
    """What `train_cell` reads from the memories after each step."""

    memories: list
    max_weight_norm: float = 0.0
    clipped_steps: int = 0
    first_clipped_step: int | None = None
    max_clipped_share: float = 0.0
    losses: list[float] = field(default_factory=list)

    def __call__(self, step: int, loss: float) -> bool:
        """Records the step; True (stop: non-finite) when a fast-weight norm is not finite."""
        self.losses.append(loss)
        stats = torch.stack([torch.stack([m.last_stats["weight_norm"].float(),
                                          m.last_stats.get("clipped_share", torch.zeros(())).float()])
                             for m in self.memories]).tolist()  # one host sync a step
        norms, shares = [s[0] for s in stats], [s[1] for s in stats]
        if not all(math.isfinite(n) for n in norms):
            return True
        self.max_weight_norm = max(self.max_weight_norm, *norms)
        if max(shares) > 0:
            self.clipped_steps += 1
            self.first_clipped_step = self.first_clipped_step or step
            self.max_clipped_share = max(self.max_clipped_share, *shares)
        return False


def train_cell(cell: Cell) -> tuple[dict, Watch]:
    """Train one cell (module docstring): (its JSON record, the per-step watch)."""
    from models.layers.diagnostics import recording
    from models.memory.neural_memory import NeuralMemory

    model = build(cell)
    watch = Watch([m for m in model.modules() if isinstance(m, NeuralMemory)])
    start = time.perf_counter()
    with recording():  # the watch reads every step's statistics
        run = mqar.train(model, mqar.Task(seq_len=cell.seq_len, num_kv=8, vocab=256), steps=cell.steps, lr=cell.lr,
                         batch_size=cell.batch_size, eval_every=10**9, eval_size=16, seed=cell.seed, weight_decay=0.1,
                         warmup_fraction=0.05 if cell.cosine_steps else 0.1, betas=(0.9, 0.999), clip_norm=1.0,
                         cosine_steps=cell.cosine_steps, after_step=watch)
    record = {"key": cell.key(), **dataclasses.asdict(cell), "memory": dict(cell.memory),
              "nonfinite_step": run.nonfinite_step,
              "last_loss": run.last_loss if math.isfinite(run.last_loss) else None,
              "max_weight_norm": watch.max_weight_norm, "clipped_steps": watch.clipped_steps,
              "first_clipped_step": watch.first_clipped_step, "max_clipped_share": watch.max_clipped_share,
              "seconds": round(time.perf_counter() - start, 2)}
    return record, watch


def done_keys(path: Path) -> set[str]:
    return {r["key"] for r in read_records(path)} if path.exists() else set()


def run(cells: list[Cell], path: Path, log=print) -> list[dict]:
    """Train the cells `path` does not hold yet, appending each record as one JSON line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    done, records = done_keys(path), []
    todo = [c for c in cells if c.key() not in done]
    log(f"titans stress: {len(cells) - len(todo)} of {len(cells)} cells done, {len(todo)} to run")
    for i, cell in enumerate(todo, 1):
        record, _ = train_cell(cell)
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        records.append(record)
        state = f"non-finite at step {record['nonfinite_step']}" if record["nonfinite_step"] else "finite"
        log(f"[{i}/{len(todo)}] {cell.key()}: {state}, clipped on {record['clipped_steps']} steps, "
            f"{record['seconds']:.0f} s")
    return records


def summary(records: list[dict]) -> str:
    """Markdown: per memory setting, variant and width, the finite cells, the cells and steps
    that clipped, the largest clipped share and fast-weight norm; then each non-finite cell."""
    lines = ["| memory | variant | width | cells | finite | cells clipped | steps clipped | max share clipped "
             "| max fast-weight norm |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    def group(r):
        return (" ".join(f"{k}={v:g}" for k, v in sorted(r["memory"].items())) or "default", r["variant"], r["width"])
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(group(r), []).append(r)
    for (memory, variant, width), rows in sorted(groups.items()):
        finite = [r for r in rows if r["nonfinite_step"] is None]
        clipped = [r for r in rows if r["clipped_steps"]]
        norm = max((r["max_weight_norm"] for r in rows), default=0.0)
        share = max((r["max_clipped_share"] for r in rows), default=0.0)
        lines.append(f"| {memory} | {variant} | {width} | {len(rows)} | {len(finite)} | {len(clipped)} | "
                     f"{sum(r['clipped_steps'] for r in rows)} | {share:.3f} | {norm:.3g} |")
    failed = [r for r in records if r["nonfinite_step"] is not None]
    if failed:
        lines += ["", "Non-finite cells (first non-finite step):", ""]
        lines += [f"- {r['key']}: step {r['nonfinite_step']}" for r in sorted(failed, key=lambda r: r["key"])]
    return "\n".join(lines)

