"""Multi-query associative recall (MQAR; Zoology, Arora et al. 2023, section 3) and a small
plain-torch training loop over the family registry: the recall yardstick at CPU scale.

A sequence is `num_kv` key-value pairs (keys from the first half of the vocabulary, values from
the second, so a model cannot confuse them), then the rest of the sequence, where each key is
asked again once at a power-law distance (most soon after the pairs, some late: Zoology's
`power_a` 0.01) and followed by its value; every other position holds a random token. Loss and
accuracy count only the positions whose next token is a recalled value (Zoology's rule).

`build_model(name, **fields)`: a family's model at any width ("transformer": torchtitan's
llama3, the Transformer++ users train; the others their plain `models/` class), from the
family's debug flavor with `fields` overriding it. `train(model, task, ...)`: AdamW, up to
`steps` steps on fresh batches, accuracy on a held-out batch every `eval_every` steps; the run
stops early (`nonfinite_step`) when the loss or a parameter stops being finite, and, given a
`Plateau`, when validation accuracy reaches its target or stops gaining; given a `Snapshot`,
a run cut short (a killed process, a session's end) resumes after its last evaluation.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

IGNORE = -100


@dataclass(frozen=True)
class Task:
    """One MQAR setting: sequences of `seq_len` tokens with `num_kv` pairs over `vocab` tokens."""

    seq_len: int = 64
    num_kv: int = 4
    vocab: int = 256
    power_a: float = 0.01

    def __post_init__(self):
        if 4 * self.num_kv > self.seq_len:
            raise ValueError(f"{self.num_kv} pairs need at least {4 * self.num_kv} tokens (pairs, then queries)")
        if self.num_kv > self.vocab // 2:
            raise ValueError(f"{self.num_kv} distinct keys need a vocabulary of at least {2 * self.num_kv}")


def batch(task: Task, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (size, seq_len): targets hold the value to recall at the
    position of its re-asked key, IGNORE elsewhere."""
    half, context = task.vocab // 2, 2 * task.num_kv
    space = (task.seq_len + 1 - context) // 2  # query slots: a key then its value
    weights = task.power_a * torch.arange(1, space + 1, dtype=torch.float64) ** (task.power_a - 1)
    keys = torch.stack([torch.randperm(half, generator=generator)[: task.num_kv] for _ in range(size)])
    values = torch.randint(half, task.vocab, (size, task.num_kv), generator=generator)
    slots = torch.stack([torch.multinomial(weights, task.num_kv, generator=generator) for _ in range(size)])
    sequence = torch.randint(0, task.vocab, (size, task.seq_len + 1), generator=generator)
    pairs = torch.stack([keys, values], dim=-1).flatten(1)  # k1 v1 k2 v2 ...
    sequence[:, :context] = pairs
    labels = torch.full_like(sequence, IGNORE)
    rows = torch.arange(size)[:, None]
    sequence[rows, context + 2 * slots] = keys
    sequence[rows, context + 2 * slots + 1] = values
    labels[rows, context + 2 * slots + 1] = values
    return sequence[:, :-1], labels[:, 1:]


def within_reach(inputs: torch.Tensor, targets: torch.Tensor, reach: int) -> torch.Tensor:
    """`targets` (B, T) with every query whose key's pair lies more than `reach` tokens back
    set to IGNORE: a loss that asks only what an attention window of `reach` tokens reaches
    (the distance `answers` reports). The pair is the key's first occurrence: the pairs open
    the sequence and their keys are distinct."""
    first = (inputs[:, :, None] == inputs[:, None, :]).int().argmax(-1)  # (B, T): where each token first occurs
    return targets.masked_fill(torch.arange(inputs.shape[1], device=inputs.device) - first > reach, IGNORE)


def mixed_batch(tasks: "Task | tuple[Task, ...]", size: int, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` over several settings of one sequence length (e.g. a few key-value counts):
    `size` sequences split as evenly as the settings allow, the first ones taking the rest."""
    tasks = (tasks,) if isinstance(tasks, Task) else tuple(tasks)
    if len({t.seq_len for t in tasks}) != 1:
        raise ValueError("mixed_batch needs one sequence length for every setting")
    sizes = [size // len(tasks) + (i < size % len(tasks)) for i in range(len(tasks))]
    parts = [batch(t, n, generator) for t, n in zip(tasks, sizes) if n]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def answers(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query outcomes of one setting's prompts: (correct (B, num_kv) bool, in the order the
    queries come; distance (B, num_kv) long: tokens from the key's pair to its query)."""
    with torch.no_grad():
        predicted = logits_of(model, inputs).argmax(-1)
    mask = targets != IGNORE
    per_row = mask.sum(1)
    if (per_row != per_row[0]).any():
        raise ValueError("answers needs prompts of one setting (as many queries each)")
    kv = int(per_row[0])
    correct = (predicted[mask] == targets[mask]).view(-1, kv)
    positions = mask.nonzero()[:, 1].view(-1, kv)  # the query key's position (its value is the next token)
    keys = inputs[:, : 2 * kv : 2]  # (B, kv)
    asked = inputs.gather(1, positions)
    pair = (asked[:, :, None] == keys[:, None, :]).float().argmax(-1)  # which pair each query re-asks
    return correct, positions - 2 * pair


def build_model(name: str, **fields) -> torch.nn.Module:
    """A model of family "<family>[_<variant>]" from its debug flavor with `fields` set (fp32,
    train mode). "transformer" is torchtitan's llama3 with torchtitan's init (`init_states`)."""
    from torchtitan_ext.families import family_and_overrides

    family, overrides = family_and_overrides(name)
    config = family.config("debug", **overrides, **fields)
    if family.name == "transformer":
        from torchtitan_ext.families.transformer import llama3_config
        from torchtitan_ext.training import cpu

        cpu.apply(flush_denormals=False)  # its device patches; train_run flushes subnormals for every row alike
        model = llama3_config(config, "cpu").build()
        model.init_states()
    else:
        model = family.plain_class(config)
    return model.float().train()


def logits_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    from torchtitan_ext.training.checkpoints import causal_logits

    out = causal_logits(model, tokens)
    return out[0] if isinstance(out, tuple) else out


def accuracy(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of recalled values predicted exactly (argmax), over every answer position."""
    with torch.no_grad():
        predicted = logits_of(model, inputs).argmax(-1)
    answers = targets != IGNORE
    return (predicted[answers] == targets[answers]).float().mean().item()


@dataclass(frozen=True)
class Plateau:
    """When a run has learned what it will: checked after every evaluation on the accuracies
    so far (one per evaluation, oldest first). "target": the last accuracy is >= `target`;
    "plateau": more than `window` evaluations ran and the best of the last `window` is at most
    `gain` above the best of those before them (no gain above `gain` over `window`
    evaluations); None: keep training."""

    target: float = 0.99
    gain: float = 0.01
    window: int = 10

    def __post_init__(self):
        if self.window < 1 or not 0 < self.target <= 1 or self.gain < 0:
            raise ValueError(f"Plateau needs window >= 1, 0 < target <= 1 and gain >= 0, not {self}")

    def reason(self, accuracies: list[float]) -> str | None:
        if accuracies and accuracies[-1] >= self.target:
            return "target"
        if len(accuracies) > self.window and max(accuracies[-self.window:]) <= max(accuracies[:-self.window]) + self.gain:
            return "plateau"
        return None


@dataclass
class Run:
    """What `train` measured: (step, accuracy) every eval, the last loss, the first step whose
    loss or parameters were not finite (None: all finite), and why it stopped: "target" or
    "plateau" (`Plateau.reason`), "non-finite", or "cap" (it ran every step)."""

    curve: list[tuple[int, float]] = field(default_factory=list)
    last_loss: float = math.nan
    nonfinite_step: int | None = None
    stop: str = "cap"
    seconds: float = 0.0  # training wall-clock, summed over the parts of a resumed run


@dataclass
class Snapshot:
    """Where `train` keeps a run resumable. After every evaluation that does not stop the run
    it writes, atomically (a temporary sibling renamed over `path`), the model, optimizer, lr
    schedule, batch generator, torch's global RNG, the `Run` so far and `progress` (the
    caller's own records, e.g. per-task accuracies, which its `evaluate` keeps in this dict).
    A later `train` given a Snapshot at the same `path` with an equal `key` (what the run is:
    its setting, row, rate, seed) loads it and goes on after that evaluation, bit for bit the
    run it would have been uncut, `progress` updated in place; a file of another key is
    ignored and overwritten. The caller deletes the file once the run's result is written."""

    path: Path
    key: dict
    progress: dict = field(default_factory=dict)

    def save(self, step: int, model, optimizer, schedule, generator: torch.Generator, run: Run) -> None:
        partial = self.path.with_suffix(".partial")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"key": self.key, "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(), "generator": generator.get_state(),
                    "rng": torch.get_rng_state(), "run": dataclasses.asdict(run), "progress": self.progress}, partial)
        partial.replace(self.path)

    def load(self, model, optimizer, schedule, generator: torch.Generator) -> tuple[int, Run]:
        """(the last step done, the Run so far) from the file, restoring everything else in
        place; (0, a fresh Run) when there is no file of this key."""
        if not self.path.is_file():
            return 0, Run()
        saved = torch.load(self.path, weights_only=False)
        if saved["key"] != self.key:
            return 0, Run()
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        generator.set_state(saved["generator"])
        torch.set_rng_state(saved["rng"])
        self.progress.update(saved["progress"])
        return saved["step"], Run(**saved["run"])


def train(model: torch.nn.Module, task: "Task | tuple[Task, ...]", *, steps: int, lr: float = 3e-3, batch_size: int = 64,
          eval_every: int = 250, eval_size: int = 256, seed: int = 0, weight_decay: float = 0.1,
          warmup_fraction: float = 0.1, betas: tuple[float, float] = (0.9, 0.95), clip_norm: float = 0.0,
          cosine_steps: int = 0, after_step: Callable[[int, float], bool] | None = None,
          evaluate: Callable[[torch.nn.Module], float] | None = None, until: Plateau | None = None,
          snapshot: Snapshot | None = None, loss_reach: int = 0, loss_reach_steps: int = 0) -> Run:
    """AdamW (betas (0.9, 0.95), weight decay 0.1 as the paper recipes; lr constant after a linear
    warmup over `warmup_fraction` of the steps), `steps` steps on fresh batches, accuracy on
    one held-out batch (its own seed) every `eval_every` steps and at the end. `task` may be
    several settings of one length (`mixed_batch`: each batch and the held-out one mix them).
    `clip_norm` > 0 clips the gradients' total norm; `cosine_steps` > 0 decays the lr by a cosine
    to 0 over that many steps after the warmup (the warmup then spans `warmup_fraction` of
    them); `after_step(step, loss)` runs after each update and returning True marks the step
    non-finite and stops the run (e.g. a memory state that left the finite range).
    `evaluate(model)` (in eval mode) replaces the held-out batch's accuracy; `until` stops the
    run after the evaluation at which `until.reason(accuracies)` names a reason (`Run.stop`);
    `snapshot` keeps the run resumable (`Snapshot`); `loss_reach` > 0 asks the loss only the
    queries whose key lies at most that many tokens back (`within_reach`; a batch with none
    left has a NaN loss and stops the run as non-finite), on the first `loss_reach_steps`
    steps (0: on every step) and every query after them (a curriculum)."""
    generator = torch.Generator().manual_seed(seed)
    if evaluate is None:
        held_out = mixed_batch(task, eval_size, torch.Generator().manual_seed(10**6 + seed))

        def evaluate(m: torch.nn.Module) -> float:
            return accuracy(m, *held_out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
    warmup = max(1, int((cosine_steps or steps) * warmup_fraction))

    def factor(s: int) -> float:
        if s < warmup or not cosine_steps:
            return min(1.0, (s + 1) / warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, cosine_steps - warmup))))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    done, run = snapshot.load(model, optimizer, schedule, generator) if snapshot is not None else (0, Run())
    began, seconds_before = time.perf_counter(), run.seconds
    for step in range(done + 1, steps + 1):
        inputs, targets = mixed_batch(task, batch_size, generator)
        if loss_reach and (not loss_reach_steps or step <= loss_reach_steps):
            targets = within_reach(inputs, targets, loss_reach)
        logits = logits_of(model, inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        optimizer.step()
        schedule.step()
        run.last_loss = loss.item()
        finite = torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all()  # one host sync, not one a tensor
        stop = after_step(step, run.last_loss) if after_step is not None else False
        if not math.isfinite(run.last_loss) or not finite.item() or stop:
            run.nonfinite_step, run.stop = step, "non-finite"
            break
        if step % eval_every == 0 or step == steps:
            run.curve.append((step, evaluate(model.eval())))
            model.train()
            reason = until.reason([a for _, a in run.curve]) if until is not None else None
            if reason is not None:
                run.stop = reason
                break
            if snapshot is not None and step < steps:
                run.seconds = seconds_before + time.perf_counter() - began
                snapshot.save(step, model, optimizer, schedule, generator, run)
    run.seconds = seconds_before + time.perf_counter() - began
    return run
