"""Pretraining data that mixes packed real text with synthetic task rows, as a torchtitan dataloader.

Each sequence of `seq_len` tokens is, by a draw from `random.Random(f"{seed}-{i}")` for
sequence i, either the next packed window of the text dataset (`TextDataLoader`'s: its
documents, BOS/EOS, positions restarting per document, the loss on every token) or the next
row of `TaskDataset` (torchtitan_ext/data/task_data.py: one sample of the tasks, its length
drawn from `lengths`, the loss on the answer and EOS only, or on the whole row with
`task_labels="row"`), the latter with probability
`task_fraction`. Both kinds are ({"input": (L,), "positions": (L,)}, labels (L,)) with
L = seq_len, so a batch mixes them freely. The task rows read the question right after the
context ("continue": the backbone has no memory, its attention must see the context).

Every rank draws the same sequence of choices and each source shards itself across ranks
(the text by sequence, the tasks by sample index); the state (the draw counter and both
sources' states) resumes from checkpoints.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader

from torchtitan_ext.data import datasets
from torchtitan_ext.data.dataloader import SequenceShardedTextDataset, TextDataLoader
from torchtitan_ext.data.task_data import TaskDataset
from torchtitan_ext.errors import UserError


class MixedDataset(IterableDataset, Stateful):
    """Yields the rows of `text` and `tasks` (two datasets of the same row format), a task row
    with probability `task_fraction` (module docstring)."""

    def __init__(self, text: IterableDataset, tasks: TaskDataset, task_fraction: float, seed: int):
        if not 0.0 <= task_fraction <= 1.0:
            raise UserError(f"task_fraction {task_fraction} must lie in 0..1")
        self.text, self.tasks, self.task_fraction, self.seed = text, tasks, task_fraction, seed
        self.index = 0

    @property
    def skipped_rows(self) -> int:
        """The text's unreadable rows skipped so far (`--dataloader.skip_bad_rows`)."""
        return self.text.skipped_rows

    def __iter__(self):
        text, tasks = iter(self.text), iter(self.tasks)
        while True:
            use_task = random.Random(f"{self.seed}-{self.index}").random() < self.task_fraction
            self.index += 1
            yield next(tasks) if use_task else next(text)

    def state_dict(self):
        return {"index": self.index, "text": self.text.state_dict(), "tasks": self.tasks.state_dict()}

    def load_state_dict(self, state_dict):
        self.index = state_dict["index"]
        self.text.load_state_dict(state_dict["text"])
        self.tasks.load_state_dict(state_dict["tasks"])


class MixedDataLoader(ParallelAwareDataloader):
    """torchtitan dataloader of `MixedDataset`: `dataset` / `dataset_path` name the text
    (torchtitan_ext/data/datasets.py), `tasks` / `lengths` / `haystack` the task rows."""

    @dataclass(kw_only=True, slots=True)
    class Config(TextDataLoader.Config):
        tasks: str = "s_niah"  # comma-separated task names (torchtitan_ext/data/synthetic_tasks.py)
        lengths: str = ""  # comma-separated task sample lengths (tokens, at most seq_len); "": seq_len
        haystack: str = ""  # needle tasks' haystack ("text", "noise"; "": the paper's per task)
        task_fraction: float = 0.5  # share of sequences that are task rows
        task_labels: str = "answer"  # the task rows' loss: on the "answer" or the whole "row" (task_data.py)
        seed: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs):
        with datasets.keeping_bad_rows(config.skip_bad_rows):
            text = SequenceShardedTextDataset(
                dataset_name=config.dataset, dataset_path=config.dataset_path, tokenizer=tokenizer,
                seq_len=seq_len, dp_rank=dp_rank, dp_world_size=dp_world_size, infinite=True,
            )
        lengths = tuple(int(n) for n in config.lengths.split(",") if n)
        tasks = TaskDataset(config.tasks.split(","), tokenizer, seq_len, config.seed, validation=False, infinite=True,
                            samples=0, dp_rank=dp_rank, dp_world_size=dp_world_size, lengths=lengths,
                            question="continue", haystack=config.haystack or None, labels=config.task_labels)
        super().__init__(
            MixedDataset(text, tasks, config.task_fraction, config.seed), dp_rank=dp_rank,
            dp_world_size=dp_world_size, batch_size=local_batch_size, num_workers=config.num_workers,
            persistent_workers=config.persistent_workers, pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor, snapshot_every_n_steps=snapshot_every_n_steps,
        )
