"""The MQAR recall suite (`python scripts/leaderboard.py --suite mqar --out DIR`): every
from-scratch family at one width and depth on Zoology's multi-query associative recall
(torchtitan_ext/eval/mqar.py), per task (key-value count x sequence length, lengths past
training included), with intervals over seeds, a cost column and the hypotheses below
answered per task.

Protocol (`Setting`): sequences of `train_len` tokens, keys and values from disjoint halves of
a `vocab` vocabulary, queries re-asking earlier keys at power-law distances, loss and
accuracy on answer positions only (Zoology's rules); the training batches mix the `train_kv`
key-value counts. Every row has `layers` blocks of width `width`. The attention of the
windowed rows spans `window` tokens, shorter than `train_len`: the window-only Transformer++
(torchtitan's llama3 with every attention masked to the last `window` tokens, `WindowedSDPA`:
the registry's llama3 has no sliding-window option on CPU, so the mask is set here), Titans
MAC (segments of `window`; `titans_mac_inputs` is its ablation writing the segment's inputs
instead of the attention outputs, TitansConfig.mac_write), MAG and MAL (sliding window of
`window`), Mela (decoder chunks of P*C = `window` tokens, each reading C memory tokens). Titans LMM has no attention; the full
Transformer++ and the MLP-FFN LM attend to every earlier token. The memory-off Mela twin is
Mela's own switch (`memory_path=False`: every chunk reads the initial memory tokens, the HMM
never runs).

Learning rate: the grid `lrs` (the same for every row) is swept on the first seed; the rate
whose run scores the highest accuracy on `val_prompts` held-out validation prompts per
training task (at `train_len`) is the row's, and the other seeds train at it. Test prompts
(`test_prompts` per task) are drawn per seed from their own generator (no prompt is shared
across seeds); within a seed every row answers the same prompts, so comparisons pair. A
prompt is one item (its queries share a sequence, so they are not independent); its value
is the share of its queries answered right, and every query's outcome and key-to-query
distance is kept in the JSON.

Intervals: 95%, seeds resampled, then prompts inside each seed (torchtitan_ext/eval/stats.py
`seed_item_bootstrap`, 2000 resamples, resampling generator seed 0, so the JSON rebuilds
them exactly); a comparison resamples the per-prompt differences of the paired rows.

Verdicts (`verdict`): per hypothesis and task, never pooled across tasks. A task on which
every row's pooled accuracy is at most FLOOR is "at floor" and has no verdict; so is a
comparison whose rows are both at most FLOOR on that task (neither can show a difference).
"at_least" (a row's accuracy a, threshold t, tolerance e): supported when the interval's low
end is >= t - e, not supported when its high end is < t - e. "better" (paired difference
d = model - control, tolerance e, smallest effect s > e): supported when low > e, not
supported when high < s (the interval rules out the smallest effect the hypothesis names);
anything else is inconclusive.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from torchtitan_ext.eval import mqar
from torchtitan_ext.eval.stats import format_summary, seed_item_bootstrap, summarize_seeds

DATE = "2026-11-26"
FLOOR = 0.05  # pooled accuracy at or below this is "at floor" (chance: 2 / vocab)
RESAMPLES = 2000


@dataclass(frozen=True)
class Setting:
    """One size of the suite (module docstring). lrs: the grid; seeds: training seeds (the
    first sweeps the grid); memory_chunk: the Titans memory's chunk; mela_patch x mela_chunk
    = window (Mela's P and C); mela_cycles: Mela's H = L (the debug flavour's 2 cost 1.7x the
    step of 1 here, Mela's HMM being ~25x a Transformer++ step: 1 to fit the CPU budget)."""

    name: str
    width: int = 64
    layers: int = 2
    heads: int = 4
    vocab: int = 64
    train_len: int = 32
    window: int = 8
    train_kv: tuple[int, ...] = (2, 4, 8)
    eval_kv: tuple[int, ...] = (2, 4, 8)
    eval_lengths: tuple[int, ...] = (32, 64, 128)
    steps: int = 900
    batch_size: int = 32
    lrs: tuple[float, ...] = (1e-3, 3e-3)
    seeds: tuple[int, ...] = (0, 1)
    val_prompts: int = 64
    test_prompts: int = 64
    memory_chunk: int = 8
    mela_patch: int = 2
    mela_chunk: int = 4
    mela_cycles: int = 1
    warmup_fraction: float = 0.1
    weight_decay: float = 0.1

    def __post_init__(self):
        if self.window >= self.train_len:
            raise ValueError(f"window {self.window} must be shorter than the training length {self.train_len}")
        if self.mela_patch * self.mela_chunk != self.window:
            raise ValueError("Mela's P * C must equal the window")
        if self.train_len not in self.eval_lengths:
            raise ValueError("the training length must be one of the evaluation lengths")

    def tasks(self) -> list[tuple[int, int]]:
        """(key-value count, length) of every test task that fits (4 * kv <= length)."""
        return [(kv, n) for kv in self.eval_kv for n in self.eval_lengths if 4 * kv <= n]

    def training_tokens(self) -> int:
        return self.steps * self.batch_size * self.train_len


SETTINGS = {
    # About 80 minutes on one core of the 2-core CPU machine, shared (docs/leaderboard.md). The
    # Transformer++ solved it at lr 3e-3 after ~450 / 600 / 700+ steps on seeds 0 / 2 / 1 in a 700-step
    # trial (vocabulary 256 at length 64 needed twice the steps at twice the batch).
    "full": Setting("full"),
    # Seconds: the form the tests run (the numbers mean nothing).
    "quick": Setting("quick", width=16, layers=2, heads=2, vocab=32, train_len=16, window=8, train_kv=(2,), eval_kv=(2,),
                     eval_lengths=(16, 32), steps=2, batch_size=4, lrs=(1e-3, 3e-3), seeds=(0, 1), val_prompts=4,
                     test_prompts=6, memory_chunk=4, mela_patch=2, mela_chunk=4),
}

# Cheapest first (Mela's HMM costs ~40x a Transformer++ step here), so a run cut short keeps most rows.
ROWS = ("transformer_full", "transformer_window", "mlp_lm", "titans_lmm", "titans_mac", "titans_mac_inputs", "titans_mag",
        "titans_mal", "mela_memory_off", "mela")
WINDOWED = {"transformer_window", "titans_mac", "titans_mac_inputs", "titans_mag", "titans_mal", "mela", "mela_memory_off"}


def row_spec(name: str, s: Setting) -> tuple[str, dict]:
    """(registry name, config fields) of a row at the setting's width and depth."""
    from models.memory.neural_memory import NeuralMemoryConfig

    common = dict(dim=s.width, n_layers=s.layers, n_heads=s.heads, vocab_size=s.vocab)
    if name.startswith("transformer"):
        return "transformer", dict(common, n_kv_heads=max(1, s.heads // 2), ffn_hidden=3 * s.width)
    if name == "titans_mac_inputs":  # the ablation writing the segment's inputs (TitansConfig.mac_write)
        return "titans_mac", dict(row_spec("titans_mac", s)[1], mac_write="inputs")
    if name.startswith("titans"):
        return name, dict(common, window=s.window, memory=NeuralMemoryConfig(chunk_size=s.memory_chunk))
    if name.startswith("mela"):
        return "mela", dict(common, memory_dim=s.width, memory_heads=s.heads, patch_size=s.mela_patch,
                            chunk_size=s.mela_chunk, h_cycles=s.mela_cycles, l_cycles=s.mela_cycles,
                            memory_path=name == "mela")
    if name == "mlp_lm":
        return "mlp_lm", dict(common, ffn_dim=4 * s.width)
    raise ValueError(f"unknown MQAR row '{name}': choose from {', '.join(ROWS)}")


class WindowedSDPA(torch.nn.Module):
    """torchtitan llama3's inner attention with each query seeing its last `window` tokens
    (itself included), one document per row (MQAR's prompts)."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        length = q.shape[1]
        i = torch.arange(length, device=q.device)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def build_row(name: str, s: Setting, **overrides) -> torch.nn.Module:
    """The row's model; `overrides` replace config fields of its `row_spec` (follow-up studies)."""
    family, fields = row_spec(name, s)
    model = mqar.build_model(family, **{**fields, **overrides})
    if name == "transformer_window":
        for layer in model.layers.values():
            layer.attention.inner_attention = WindowedSDPA(s.window)
    return model


# --- hypotheses, written before the run ------------------------------------------------------

@dataclass(frozen=True)
class Hypothesis:
    """A claim written before the run, answered per task in its scope. metric: "accuracy"
    (the model row's, sense "at_least" a threshold) or "accuracy_difference" (model - control,
    paired, sense "better"); tolerance, threshold, smallest_effect: in accuracy units;
    expected_width: the 95% interval's width expected from the design; lengths: "trained"
    (the training length), "past" (longer ones) or "all"."""

    key: str
    claim: str
    model: str
    control: str | None
    metric: str
    sense: str
    tolerance: float
    smallest_effect: float
    expected_width: float
    threshold: float | None = None
    lengths: str = "trained"
    why: str = ""

    def in_scope(self, length: int, train_len: int) -> bool:
        return {"trained": length == train_len, "past": length > train_len, "all": True}[self.lengths]


HYPOTHESES = (
    Hypothesis("H1", "Transformer++ full attention solves MQAR at its trained length", "transformer_full", None,
               "accuracy", "at_least", tolerance=0.02, smallest_effect=0.0, expected_width=0.05, threshold=0.9,
               why="Zoology: attention solves MQAR at every width; the yardstick's own check"),
    Hypothesis("H2", "Titans LMM beats the window-only Transformer++ at length > window", "titans_lmm",
               "transformer_window", "accuracy_difference", "better", tolerance=0.02, smallest_effect=0.1,
               expected_width=0.15, lengths="all",
               why="issue 40's example; a memory reaches keys that fell out of the window"),
    Hypothesis("H3", "Titans MAC beats the window-only Transformer++ at length > window", "titans_mac",
               "transformer_window", "accuracy_difference", "better", tolerance=0.02, smallest_effect=0.1,
               expected_width=0.15, lengths="all", why="Titans: the memory serves what the window cannot"),
    Hypothesis("H4", "Titans MAG beats the window-only Transformer++ at length > window", "titans_mag",
               "transformer_window", "accuracy_difference", "better", tolerance=0.02, smallest_effect=0.1,
               expected_width=0.15, lengths="all", why="as H3"),
    Hypothesis("H5", "Titans MAL beats the window-only Transformer++ at length > window", "titans_mal",
               "transformer_window", "accuracy_difference", "better", tolerance=0.02, smallest_effect=0.1,
               expected_width=0.15, lengths="all", why="as H3"),
    Hypothesis("H6", "Mela beats its memory-off twin", "mela", "mela_memory_off", "accuracy_difference", "better",
               tolerance=0.02, smallest_effect=0.1, expected_width=0.15, lengths="all",
               why="Mela's HMM carries the context past the decoder's chunk"),
    Hypothesis("H7", "Transformer++ full attention beats window-only at its trained length", "transformer_full",
               "transformer_window", "accuracy_difference", "better", tolerance=0.02, smallest_effect=0.1,
               expected_width=0.15, why="control of the design: queries past the window exist and need them"),
    Hypothesis("H8", "Titans MAC beats Transformer++ full attention past the trained length", "titans_mac",
               "transformer_full", "accuracy_difference", "better", tolerance=0.02, smallest_effect=0.1,
               expected_width=0.2, lengths="past", why="Titans: a memory extrapolates past the trained context"),
    Hypothesis("H9", "Titans MAC writing its segment's inputs beats MAC writing attention outputs", "titans_mac_inputs",
               "titans_mac", "accuracy_difference", "better", tolerance=0.02, smallest_effect=0.1, expected_width=0.2,
               lengths="all", why="written 2026-11-26 after the first run, before this row ran: one seed of the "
               "ablation reached 0.87 validation accuracy where the paper's MAC reached 0.17 (docs/leaderboard.md)"),
)


# --- the run ------------------------------------------------------------------------------

def prompts(s: Setting, kv: int, length: int, count: int, seed: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` prompts of one task, from a generator of their own per seed, split and task."""
    offset = {"test": 0, "validation": 7_919}[split]
    generator = torch.Generator().manual_seed(1_000_003 * (seed + 1) + 10_007 * kv + length + offset)
    return mqar.batch(mqar.Task(seq_len=length, num_kv=kv, vocab=s.vocab), count, generator)


def validation_accuracy(model: torch.nn.Module, s: Setting, seed: int) -> float:
    model.eval()
    scores = [mqar.accuracy(model, *prompts(s, kv, s.train_len, s.val_prompts, seed, "validation")) for kv in s.train_kv]
    model.train()
    return sum(scores) / len(scores)


def train_run(name: str, s: Setting, seed: int, lr: float, build=build_row) -> tuple[torch.nn.Module, dict]:
    """One row trained at one seed and rate: (model, record). `build(name, s)` makes the model
    (after `torch.manual_seed(seed)`)."""
    torch.manual_seed(seed)
    model = build(name, s)
    tasks = tuple(mqar.Task(seq_len=s.train_len, num_kv=kv, vocab=s.vocab) for kv in s.train_kv)
    start = time.perf_counter()
    run = mqar.train(model, tasks, steps=s.steps, lr=lr, batch_size=s.batch_size, eval_every=max(1, s.steps // 4),
                     eval_size=s.val_prompts, seed=10_000 + seed, weight_decay=s.weight_decay,
                     warmup_fraction=s.warmup_fraction)
    seconds = time.perf_counter() - start
    steps_done = run.nonfinite_step or s.steps
    record = {"seed": seed, "lr": lr, "train_seconds": seconds, "train_tokens_per_s": steps_done * s.batch_size * s.train_len / seconds,
              "nonfinite_step": run.nonfinite_step, "curve": run.curve, "last_loss": run.last_loss,
              "val_accuracy": validation_accuracy(model, s, seed) if run.nonfinite_step is None else -1.0}
    return model, record


def test_items(model: torch.nn.Module, s: Setting, seed: int) -> dict:
    """{task key: {"kv", "length", "correct": per prompt, per query 0/1, "distance": per query}}."""
    model.eval()
    out = {}
    for kv, length in s.tasks():
        inputs, targets = prompts(s, kv, length, s.test_prompts, seed, "test")
        correct, distance = [], []
        for start in range(0, len(inputs), 64):
            c, d = mqar.answers(model, inputs[start:start + 64], targets[start:start + 64])
            correct.append(c)
            distance.append(d)
        out[task_key(kv, length)] = {"kv": kv, "length": length, "correct": torch.cat(correct).int().tolist(),
                                     "distance": torch.cat(distance).tolist()}
    return out


def task_key(kv: int, length: int) -> str:
    return f"kv{kv}_len{length}"


def cost(name: str, s: Setting, model: torch.nn.Module) -> dict:
    """Trainable parameters, FLOPs per token (FlopCounterMode over one training step and one
    evaluation forward at the training length; the family's own analytic count where it has
    one) and memory-state bytes at the training length (module docstring of `state_bytes_of`)."""
    from torch.utils.flop_counter import FlopCounterMode

    from torchtitan_ext import flops

    tokens = prompts(s, s.train_kv[0], s.train_len, 2, 0, "validation")[0]
    model.train()
    with FlopCounterMode(display=False, custom_mapping=flops.CPU_ATTENTION_FLOPS) as counter:
        mqar.logits_of(model, tokens).logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)
    train_flops = counter.get_total_flops() / tokens.numel()
    model.eval()
    with FlopCounterMode(display=False, custom_mapping=flops.CPU_ATTENTION_FLOPS) as counter:
        mqar.logits_of(model, tokens)  # forward only (under no_grad the counter's module hooks fail on Titans)
    eval_flops = counter.get_total_flops() / tokens.numel()
    return {"trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "train_flops_per_token": train_flops, "eval_flops_per_token": eval_flops,
            "analytic_train_flops_per_token": analytic_flops(name, s), "state_bytes": state_bytes_of(name, s, model),
            "training_tokens": s.training_tokens()}


def analytic_flops(name: str, s: Setting) -> float | None:
    """The family registry's own training FLOPs per token (None where the family has none:
    the Transformer++, counted by torchtitan's estimate in training)."""
    from torchtitan_ext.families import family_and_overrides

    registry, fields = row_spec(name, s)
    family, overrides = family_and_overrides(registry)
    if family.flops_per_token is None:
        return None
    return float(family.flops_per_token(family.config("debug", **overrides, **fields), s.train_len))


def state_bytes_of(name: str, s: Setting, model: torch.nn.Module) -> int:
    """What a row carries after reading one prompt of the training length (batch 1, fp32):
    the key/value cache of the attention rows (every token for full attention, the last
    `window` for the window-only row), the stream state (memories and caches) of Titans and
    Mela (`stream`)."""
    from torchtitan_ext.eval.leaderboard_cells import state_bytes

    if hasattr(model, "stream"):
        tokens = prompts(s, s.train_kv[0], s.train_len, 1, 0, "validation")[0]
        with torch.no_grad():
            return state_bytes(model.stream(tokens)[1])
    _, fields = row_spec(name, s)
    kv_heads = fields.get("n_kv_heads") or fields["n_heads"]
    span = s.window if name == "transformer_window" else s.train_len
    return 2 * s.layers * span * kv_heads * (s.width // s.heads) * 4


def run_row(name: str, s: Setting, log=print) -> dict:
    """A row's sweep, its seeds at the chosen rate, their test items and its cost."""
    first, rest = s.seeds[0], s.seeds[1:]
    sweep, models = [], {}
    for lr in s.lrs:
        model, record = train_run(name, s, first, lr)
        sweep.append(record)
        models[lr] = model
        log(f"{name} seed {first} lr {lr:g}: validation {record['val_accuracy']:.3f} "
            f"({record['train_seconds']:.0f} s{', non-finite at step %d' % record['nonfinite_step'] if record['nonfinite_step'] else ''})")
    best = max(sweep, key=lambda r: r["val_accuracy"])  # first of the grid on a tie
    seeds = {str(first): {**best, "tasks": test_items(models[best["lr"]], s, first)}}
    row_cost = cost(name, s, models[best["lr"]])
    del models
    for seed in rest:
        model, record = train_run(name, s, seed, best["lr"])
        seeds[str(seed)] = {**record, "tasks": test_items(model, s, seed)}
        log(f"{name} seed {seed} lr {best['lr']:g}: validation {record['val_accuracy']:.3f} ({record['train_seconds']:.0f} s)")
    registry, fields = row_spec(name, s)
    row_cost["train_seconds"] = sum(r["train_seconds"] for r in seeds.values()) / len(seeds)
    row_cost["train_tokens_per_s"] = sum(r["train_tokens_per_s"] for r in seeds.values()) / len(seeds)
    return {"registry": registry, "fields": {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
                                             for k, v in fields.items()},
            "windowed": name in WINDOWED, "best_lr": best["lr"], "sweep": sweep, "seeds": seeds, "cost": row_cost}


# --- statistics and verdicts (from the JSON alone) ------------------------------------------

def prompt_values(row: dict, key: str) -> list[list[float]]:
    """Per seed (in seed order), each prompt's share of queries answered right on task `key`."""
    return [[sum(q) / len(q) for q in row["seeds"][seed]["tasks"][key]["correct"]]
            for seed in sorted(row["seeds"], key=int)]


def summaries(results: dict) -> dict:
    """{row: {task: summarize_seeds of its per-prompt accuracy}}."""
    return {name: {key: summarize_seeds(prompt_values(row, key), resamples=RESAMPLES)
                   for key in next(iter(row["seeds"].values()))["tasks"]}
            for name, row in results["rows"].items()}


def by_distance(results: dict) -> dict:
    """Exploratory (added after the first run was started, not a hypothesis): per row, the
    share of queries answered right at the training length, every key-value count and seed
    pooled, split by the key's distance: within the window (<= window tokens back, where the
    windowed rows' attention reaches the pair's value) and beyond it. {row: {"inside": [right,
    asked], "beyond": [right, asked]}}."""
    s = results["setting"]
    out = {}
    for name, row in results["rows"].items():
        counts = {"inside": [0, 0], "beyond": [0, 0]}
        for seed in row["seeds"].values():
            for task in seed["tasks"].values():
                if task["length"] != s["train_len"]:
                    continue
                for right, far in zip(task["correct"], task["distance"]):
                    for ok, d in zip(right, far):
                        side = counts["inside" if d <= s["window"] else "beyond"]
                        side[0] += ok
                        side[1] += 1
        out[name] = counts
    return out


def floor_tasks(results: dict, table: dict) -> list[str]:
    """Tasks on which every row's pooled accuracy is at most FLOOR."""
    keys = next(iter(table.values())).keys() if table else []
    return [k for k in keys if all(table[row][k]["pooled"] <= results["floor"] for row in table)]


def verdict(h: dict, interval: tuple[float, float]) -> str:
    """The module docstring's rule for one hypothesis (its JSON dict) on one task's interval."""
    low, high = interval
    if h["sense"] == "at_least":
        bar = h["threshold"] - h["tolerance"]
        return "supported" if low >= bar else "not supported" if high < bar else "inconclusive"
    if h["sense"] == "better":
        return ("supported" if low > h["tolerance"] else "not supported" if high < h["smallest_effect"]
                else "inconclusive")
    raise ValueError(f"unknown sense {h['sense']}")


def verdicts(results: dict) -> list[dict]:
    """Every hypothesis answered on every task in its scope, from the JSON's items alone."""
    table = summaries(results)
    floored = set(floor_tasks(results, table))
    out = []
    for h in results["hypotheses"]:
        rows = [h["model"]] + ([h["control"]] if h["control"] else [])
        if any(r not in results["rows"] for r in rows):
            out.append({"hypothesis": h["key"], "task": None, "verdict": "not run", "ci95": None, "estimate": None})
            continue
        for key, task in next(iter(results["rows"][h["model"]]["seeds"].values()))["tasks"].items():
            if not Hypothesis(**h).in_scope(task["length"], results["setting"]["train_len"]):
                continue
            model = prompt_values(results["rows"][h["model"]], key)
            if h["control"]:
                control = prompt_values(results["rows"][h["control"]], key)
                values = [[a - b for a, b in zip(m, c)] for m, c in zip(model, control)]
            else:
                values = model
            estimate = sum(map(sum, values)) / sum(map(len, values))
            interval = seed_item_bootstrap(values, resamples=RESAMPLES)
            if key in floored:
                answer = "at floor (task)"
            elif h["control"] and all(table[r][key]["pooled"] <= results["floor"] for r in rows):
                answer = "at floor (both rows)"
            else:
                answer = verdict(h, interval)
            out.append({"hypothesis": h["key"], "task": key, "estimate": estimate, "ci95": list(interval),
                        "ci_width": interval[1] - interval[0], "verdict": answer})
    return out


# --- the suite ---------------------------------------------------------------------------

def run_suite(s: Setting, out: Path, rows: tuple[str, ...] = ROWS, log=print) -> dict:
    """Every row (a finished row's DIR/rows/<row>.json is reused), then DIR/mqar.json and
    DIR/mqar.md (and DIR/mqar_accuracy.png)."""
    torch.set_flush_denormal(True)
    (out / "rows").mkdir(parents=True, exist_ok=True)
    results = {"suite": "mqar", "date": DATE, "setting": dataclasses.asdict(s), "floor": FLOOR,
               "resamples": RESAMPLES, "lr_grid": list(s.lrs),
               "selection": f"lr swept on seed {s.seeds[0]}, best by validation accuracy ({s.val_prompts} held-out "
                            f"prompts per training task at length {s.train_len}); seeds {list(s.seeds[1:])} at that lr",
               "hypotheses": [dataclasses.asdict(h) for h in HYPOTHESES], "rows": {}}
    results = json.loads(json.dumps(results))  # as the JSON holds it (tuples as lists), so a rerun compares like with like
    start = time.perf_counter()
    for name in rows:
        path = out / "rows" / f"{name}.json"
        if path.is_file() and json.loads(path.read_text()).get("setting") == results["setting"]:
            results["rows"][name] = json.loads(path.read_text())["row"]
            log(f"{name}: reused {path}")
            continue
        results["rows"][name] = run_row(name, s, log)
        path.write_text(json.dumps({"setting": results["setting"], "row": results["rows"][name]}))
    results["wall_seconds"] = time.perf_counter() - start
    table = summaries(results)
    results["summary"] = table
    results["floor_tasks"] = floor_tasks(results, table)
    results["verdicts"] = verdicts(results)
    (out / "mqar.json").write_text(json.dumps(results, indent=None))
    (out / "mqar.md").write_text(markdown(results))
    try:
        plot(results, out / "mqar_accuracy.png")
    except ImportError:  # matplotlib is optional
        pass
    return results


def _si(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def headline(results: dict) -> list[str]:
    """The headline table: row, cost, accuracy at the training length per key-value count
    (interval over seeds then prompts), accuracy at the longest length, verdicts naming the row."""
    s = results["setting"]
    trained = [task_key(kv, s["train_len"]) for kv in s["eval_kv"] if 4 * kv <= s["train_len"]]
    longest = max(s["eval_lengths"])
    past = [task_key(kv, longest) for kv in s["eval_kv"] if 4 * kv <= longest]
    by_row: dict[str, list[str]] = {}
    for v in results["verdicts"]:
        h = next(h for h in results["hypotheses"] if h["key"] == v["hypothesis"])
        if v["task"]:
            by_row.setdefault(h["model"], []).append(f"{h['key']} {v['task'].replace('_len', '@')}: {v['verdict']}")
    lines = ["| row | best lr | params | train FLOPs/tok | tok/s | state | "
             + " | ".join(f"acc {k.replace('_len', ' @')}" for k in trained)
             + " | " + " | ".join(f"acc {k.replace('_len', ' @')}" for k in past) + " | verdicts (model side) |",
             "| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in trained + past) + " | --- |"]
    for name, row in results["rows"].items():
        c = row["cost"]
        cells = [format_summary(results["summary"][name][k], digits=2) for k in trained + past]
        lines.append(f"| {name} | {row['best_lr']:g} | {_si(c['trainable_params'])} | {_si(c['train_flops_per_token'])} | "
                     f"{c['train_tokens_per_s']:,.0f} | {_si(c['state_bytes'])}B | " + " | ".join(cells)
                     + f" | {'; '.join(by_row.get(name, [])) or '-'} |")
    return lines


def markdown(results: dict) -> str:
    s = results["setting"]
    lines = [f"# MQAR suite ({results['date']}, setting `{s['name']}`)", "",
             f"Width {s['width']}, {s['layers']} layers, vocabulary {s['vocab']}, trained at length {s['train_len']} on "
             f"{list(s['train_kv'])} key-value pairs, window {s['window']} for the windowed rows, "
             f"{s['steps']} steps of {s['batch_size']} ({s['steps'] * s['batch_size'] * s['train_len']:,} training tokens "
             f"a run), seeds {list(s['seeds'])}, {s['test_prompts']} test prompts per task and seed (drawn per seed). "
             f"LR grid {results['lr_grid']}: {results['selection']}. Accuracy: share of queries answered right, "
             f"pooled (95% interval over seeds, then prompts); seeds. At floor (every row <= {results['floor']}): "
             f"{', '.join(results['floor_tasks']) or 'none'}.", "", *headline(results), "",
             "## Accuracy per task", ""]
    keys = list(next(iter(results["summary"].values())))
    lines += ["| row | " + " | ".join(k.replace("_len", " @") for k in keys) + " |",
              "| --- | " + " | ".join("---" for _ in keys) + " |"]
    for name, table in results["summary"].items():
        lines.append(f"| {name} | " + " | ".join(format_summary(table[k], digits=2) for k in keys) + " |")
    lines += ["", "## Hypotheses (written before the run) and verdicts per task", ""]
    for h in results["hypotheses"]:
        rule = (f"accuracy >= {h['threshold']} (tolerance {h['tolerance']})" if h["sense"] == "at_least" else
                f"paired difference {h['model']} - {h['control']} > {h['tolerance']} (supported), "
                f"< {h['smallest_effect']} ruled out (not supported)")
        lines.append(f"- **{h['key']}: {h['claim']}** ({rule}; lengths: {h['lengths']}; expected 95% width "
                     f"{h['expected_width']})")
        for v in results["verdicts"]:
            if v["hypothesis"] == h["key"]:
                interval = "-" if v["ci95"] is None else (f"{v['estimate']:.3f} ({v['ci95'][0]:.3f} to {v['ci95'][1]:.3f}, "
                                                          f"width {v['ci_width']:.3f})")
                lines.append(f"  - {v['task']}: {interval}: {v['verdict']}")
    lines += ["", "## Cost", "", "| row | training tokens | trainable params | train FLOPs/token (measured; analytic) | "
              "eval FLOPs/token | train wall s (per run) | train tokens/s | memory state bytes |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in results["rows"].items():
        c = row["cost"]
        lines.append(f"| {name} | {c['training_tokens']:,} | {c['trainable_params']:,} | {_si(c['train_flops_per_token'])}; "
                     f"{_si(c['analytic_train_flops_per_token'])} | {_si(c['eval_flops_per_token'])} | "
                     f"{c['train_seconds']:.0f} | {c['train_tokens_per_s']:,.0f} | {c['state_bytes']:,} |")
    lines += ["", "## Learning-rate sweep (validation accuracy, first seed)", "",
              "| row | " + " | ".join(f"lr {lr:g}" for lr in results["lr_grid"]) + " | chosen |",
              "| --- | " + " | ".join("---" for _ in results["lr_grid"]) + " | --- |"]
    for name, row in results["rows"].items():
        cells = [f"{r['val_accuracy']:.3f}" + (f" (non-finite at {r['nonfinite_step']})" if r["nonfinite_step"] else "")
                 for r in row["sweep"]]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['best_lr']:g} |")
    split = by_distance(results)
    lines += ["", f"## Exploratory: by the key's distance (training length {s['train_len']}, window {s['window']})", "",
              "Added after the run was started, not a hypothesis: queries whose pair lies within the window (<= "
              f"{s['window']} tokens back) and beyond it, every key-value count and seed pooled (queries, not "
              "independent items: no interval). Mela's window is its decoder chunk and MAC's its segment, so their "
              "split is approximate.", "", "| row | within the window | beyond the window |", "| --- | --- | --- |"]
    for name, counts in split.items():
        cells = [f"{c[0] / c[1]:.3f} ({c[1]:,} queries)" if c[1] else "-" for c in (counts["inside"], counts["beyond"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Wall times and tokens/s are single timings on a shared 2-core machine (no interval)."]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Accuracy by length, one panel per key-value count, every row its own colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["setting"]
    colours = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(1, len(s["eval_kv"]), figsize=(5 * len(s["eval_kv"]), 4), squeeze=False)
    for ax, kv in zip(axes[0], s["eval_kv"]):
        for colour, (name, table) in zip(colours, results["summary"].items()):
            lengths = [n for n in s["eval_lengths"] if task_key(kv, n) in table]
            if not lengths:
                continue
            pooled = [table[task_key(kv, n)]["pooled"] for n in lengths]
            low = [table[task_key(kv, n)]["ci95"][0] for n in lengths]
            high = [table[task_key(kv, n)]["ci95"][1] for n in lengths]
            ax.errorbar(lengths, pooled, yerr=[[p - lo for p, lo in zip(pooled, low)], [hi - p for p, hi in zip(pooled, high)]],
                        marker="o", color=colour, label=name, capsize=2)
        ax.axvline(s["train_len"], color="grey", linestyle=":")
        ax.set(xscale="log", xlabel="sequence length (dotted: trained)", ylabel="accuracy", ylim=(-0.05, 1.05),
               title=f"{kv} key-value pairs")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
