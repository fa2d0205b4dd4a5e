"""Finetuning data from the synthetic memory tasks (`torchtitan_ext/data/synthetic_tasks.py`): the
generators `scripts/eval_tasks.py` scores, as a torchtitan dataloader.

Each sequence is one sample: BOS, context and query (as long as fits, found the way
eval_tasks.py finds it), the answer text, EOS, then padding to `seq_len + 1` tokens. A
sample fills the sequence, or with `lengths` (e.g. MoNe's 2 to 8 segments of 512 tokens,
"1024,1536,...,4096") takes a length drawn per sample from that list. Labels
(`labels`, `LABELS`) are the next tokens on the answer and EOS only (IGNORE_INDEX elsewhere),
so the loss is the answer's (MoNe's "loss on answer tokens only"), or with labels="row" the
next tokens of the whole sample (context, question, answer, EOS; padding ignored): the
in-house backbone's pretraining (train_configs/backbone.py), where copying the needle's
key and the filler's repeats gives its attention the induction signal that a few answer
tokens per row did not (measured there). The answer is what eval_tasks.py scores:
kv_retrieval the value, niah " " + the value, fwe " " + the three words.

`question` (`QUESTIONS`) places the question:
- "new_segment" (default; MoNe's query phase, paper 004 section 3.4 and A.1): each row is
  two documents, BOS + context, then question + answer + EOS + padding, encoded apart, with
  `positions` restarting at 0 where the question starts. MoNe writes the whole context into
  its memory (its last, short segment too) and reads the question as a new segment at
  positions [0, Q), attending to the memory tokens and itself only (models/grafts/mone.py);
  a prefix memory (GradMem) reads [memory; question] the same way; a model whose attention
  is its only memory cannot see the context.
- "continue" (the former rows): one document per row (positions 0..L-1), the question
  continuing the context, so it attends to the context's last tokens (for MoNe, those of its
  segment). Answer tokens are those after the longest common prefix of the prompt's and
  the prompt-plus-answer's encodings (a merge across the boundary is labelled).
`split_context` is GradMem's name for the "new_segment" rows (its configs set it).
`pairs` (kv_retrieval only) draws each sample's number of key-value pairs from a list
instead of filling the row (GradMem's Table 1 counts pairs). `haystack` picks the needle
tasks' haystack (torchtitan_ext/data/synthetic_tasks.py: "text", "noise"; "": the paper's per task).

Sample i (tasks taken in turn) is drawn from `random.Random(f"{seed}-{split}-{i}")`: the
same data for any number of ranks (rank r of W takes i = r, r + W, ...), resumable from
the iterator state saved in checkpoints; the validation split draws from other seeds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

from torchtitan_ext.errors import UserError
from torchtitan_ext.data.synthetic_tasks import check_haystack, fit_sample, kv_pairs, TASKS

QUESTIONS = ("new_segment", "continue")
LABELS = ("answer", "row")
ANSWER_PREFIX = {"kv_retrieval": "", "s_niah": " ", "mk_niah": " ", "fwe": " "}
MAX_ANSWER_TOKENS = 24  # room kept for the answer and EOS when fitting the context


def answer_text(task: str, answers: list[str]) -> str:
    return ANSWER_PREFIX[task] + " ".join(answers)


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def with_answer(task: str, sample, prompt: list[int], tokenizer) -> tuple[list[int], int]:
    """(ids of BOS + context + query + answer + EOS, index of the first answer token) of a
    sample whose prompt (BOS + context + query) encodes as `prompt` (module docstring)."""
    full = tokenizer.encode(sample.context + sample.query + answer_text(task, sample.answers), add_bos=True,
                            add_eos=True)
    return full, shared_prefix(prompt, full)


def split_with_answer(task: str, sample, tokenizer) -> tuple[list[int], int, int]:
    """(ids of BOS + context, then query + answer + EOS; index of the first answer token;
    index of the query's first token): context and query encoded apart."""
    context = tokenizer.encode(sample.context, add_bos=True, add_eos=False)
    query = tokenizer.encode(sample.query, add_bos=False, add_eos=False)
    rest = tokenizer.encode(sample.query + answer_text(task, sample.answers), add_bos=False, add_eos=True)
    return context + rest, len(context) + shared_prefix(query, rest), len(context)


def encode_sample(task: str, rng: random.Random, tokenizer, length: int, split_context: bool = False,
                  pairs: int = 0, haystack: str | None = None) -> tuple[list[int], int, int]:
    """(ids, first answer token, first query token) of a sample of at most `length` tokens:
    `with_answer`'s (query index 0), or with `split_context` (question="new_segment")
    `split_with_answer`'s; `pairs`: a kv_retrieval sample of that many pairs instead of the
    longest that fits; `haystack`: the needle tasks' (None: the paper's)."""
    if pairs:
        sample = kv_pairs(rng, pairs)
    else:
        prompt, sample = fit_sample(task, rng, tokenizer, length - MAX_ANSWER_TOKENS, haystack)
    if split_context:
        full, start, query = split_with_answer(task, sample, tokenizer)
    else:
        prompt = tokenizer.encode(sample.context + sample.query, add_bos=True, add_eos=False) if pairs else prompt
        (full, start), query = with_answer(task, sample, prompt, tokenizer), 0
    if len(full) > length:
        if pairs:
            raise UserError(f"a sample of {pairs} key-value pairs takes {len(full)} tokens, more than {length}: "
                            "use a longer --training.seq_len")
        raise UserError(f"a {task} answer does not fit in {length} tokens: use a longer --training.seq_len")
    return full, start, query


class TaskDataset(IterableDataset, Stateful):
    """Yields ({"input": (L,), "positions": (L,)}, labels (L,)) with L = seq_len (module docstring)."""

    def __init__(self, tasks: list[str], tokenizer, seq_len: int, seed: int, validation: bool, infinite: bool,
                 samples: int, dp_rank: int, dp_world_size: int, lengths: tuple[int, ...] = (),
                 split_context: bool = False, pairs: tuple[int, ...] = (), question: str = "new_segment",
                 haystack: str | None = None, labels: str = "answer"):
        unknown = [t for t in tasks if t not in TASKS]
        if unknown or not tasks:
            raise UserError(f"unknown task(s) {unknown}: choose from {list(TASKS)} (comma-separated)")
        if pairs and (tasks != ["kv_retrieval"] or min(pairs) < 1):
            raise UserError(f"task pairs {list(pairs)} need --dataloader.tasks kv_retrieval and counts of at least 1")
        if question not in QUESTIONS:
            raise UserError(f"unknown task question '{question}': choose from {list(QUESTIONS)}")
        if split_context and question == "continue":
            raise UserError("split_context rows start the question as a new document: drop split_context or pass "
                            "question new_segment")
        if labels not in LABELS:
            raise UserError(f"unknown task labels '{labels}': choose from {list(LABELS)}")
        check_haystack(haystack)
        self.labels_on_row = labels == "row"
        self.split_context, self.pairs, self.haystack = split_context or question == "new_segment", pairs, haystack
        if any(not MAX_ANSWER_TOKENS < n <= seq_len for n in lengths):
            raise UserError(f"task sample lengths {list(lengths)} must lie in {MAX_ANSWER_TOKENS + 1}..{seq_len} "
                            "(seq_len): shorten them or raise --training.seq_len")
        self.lengths = lengths
        self.tasks, self.tokenizer, self.seq_len = tasks, tokenizer, seq_len
        self.split = f"{seed}-{'validation' if validation else 'train'}"
        self.infinite, self.samples = infinite, samples
        self.rank, self.world = dp_rank, dp_world_size
        self.next_index = dp_rank
        self._check_every_length_holds_a_sample()

    def _check_every_length_holds_a_sample(self) -> None:
        """Encode one sample of every (task, length, pairs) the rows draw from, so a length
        too short for a task stops the run when its dataloader is built (one line), not at
        the step that first draws it."""
        for task in self.tasks:
            for length in self.lengths or (self.seq_len,):
                for pairs in self.pairs or (0,):
                    try:
                        encode_sample(task, random.Random(f"{self.split}-check"), self.tokenizer, length + 1,
                                      self.split_context, pairs, self.haystack)
                    except UserError as e:
                        raise UserError(f"task sample length {length} cannot hold a {task} sample ({e}): "
                                        "drop it from --dataloader.lengths or raise it") from None

    def sample(self, index: int):
        task = self.tasks[index % len(self.tasks)]
        rng = random.Random(f"{self.split}-{index}")
        length = rng.choice(self.lengths) if self.lengths else self.seq_len
        pairs = rng.choice(self.pairs) if self.pairs else 0
        # + 1: inputs and labels are shifted
        ids, start, query = encode_sample(task, rng, self.tokenizer, length + 1, self.split_context, pairs,
                                          self.haystack)
        pad = self.seq_len + 1 - len(ids)
        tokens = torch.tensor(ids + [self.tokenizer.eos_id] * pad)
        labels = tokens[1:].clone()
        if not self.labels_on_row:
            labels[: start - 1] = IGNORE_INDEX
        elif query:  # the context's last token does not predict the question, another document
            labels[query - 1] = IGNORE_INDEX
        labels[len(ids) - 1:] = IGNORE_INDEX
        positions = torch.cat([torch.arange(query), torch.arange(self.seq_len - query)])
        return {"input": tokens[:-1], "positions": positions}, labels

    def __iter__(self):
        while self.infinite or self.next_index < self.samples:
            index = self.next_index
            self.next_index += self.world
            yield self.sample(index)

    def state_dict(self):
        return {"next_index": self.next_index}

    def load_state_dict(self, state_dict):
        self.next_index = state_dict["next_index"]


class TaskDataLoader(ParallelAwareDataloader):
    """torchtitan dataloader of `TaskDataset` (`tasks`: comma-separated names)."""

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTextDataLoader.Config):
        tasks: str = ",".join(TASKS)
        lengths: str = ""  # comma-separated sample lengths (input tokens), one drawn per sample; "": seq_len
        seed: int = 0
        validation: bool = False
        samples: int = 64  # per epoch when not infinite (validation)
        split_context: bool = False  # GradMem's name for question "new_segment" (its configs set it)
        pairs: str = ""  # comma-separated kv_retrieval pair counts, one drawn per sample; "": fill the row
        question: str = "new_segment"  # "new_segment": rows [context | question] of two documents; "continue": one
        haystack: str = ""  # needle tasks: "text" (held-out prose) or "noise" (filler sentences); "": the paper's
        labels: str = "answer"  # the loss on "answer" (and EOS) or on the whole "row" (module docstring)

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs):
        lengths = tuple(int(n) for n in config.lengths.split(",") if n)
        pairs = tuple(int(n) for n in config.pairs.split(",") if n)
        dataset = TaskDataset(config.tasks.split(","), tokenizer, seq_len, config.seed, config.validation,
                              config.infinite, config.samples, dp_rank, dp_world_size, lengths,
                              config.split_context, pairs, config.question, config.haystack or None, config.labels)
        super().__init__(
            dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size,
            num_workers=config.num_workers, persistent_workers=config.persistent_workers,
            pin_memory=config.pin_memory, prefetch_factor=config.prefetch_factor,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )
