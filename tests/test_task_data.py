"""Finetuning data from the synthetic tasks (torchtitan_ext/data/task_data.py): labels on the
answer only, the eval's answers, rank sharding, resumption, the split, where the question
goes (MoNe's query phase through a real MoNe model)."""

from __future__ import annotations

import random

import pytest
import torch
from torchtitan.components.loss import IGNORE_INDEX

from torchtitan_ext.errors import UserError
from torchtitan_ext.data.synthetic_tasks import fit_sample, score, TASKS
from torchtitan_ext.data.task_data import MAX_ANSWER_TOKENS, split_with_answer, TaskDataLoader, TaskDataset
from torchtitan_ext.data.tokenizer import AssetsTokenizer

SEQ_LEN = 256


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(tokenizer_dir))


def dataset(tokenizer, tasks=TASKS, rank=0, world=1, validation=False, infinite=True, **options):
    return TaskDataset(list(tasks), tokenizer, SEQ_LEN, seed=0, validation=validation, infinite=infinite, samples=8,
                       dp_rank=rank, dp_world_size=world, **options)


def question_start(positions: torch.Tensor) -> int:
    """Where a row's positions restart (its question starts a new document), or 0."""
    restarts = (positions[1:] == 0).nonzero()
    return int(restarts[0]) + 1 if len(restarts) else 0


@pytest.mark.parametrize("question", ["new_segment", "continue"])
def test_labels_are_the_answer_and_eos_which_the_eval_scores_right(tokenizer, question):
    """Both placements: labels on the answer and EOS; "new_segment" rows are [BOS + context |
    question + answer + EOS + padding] with positions restarting at the question, context and
    question encoded apart; "continue" rows (the former default) one document encoded whole."""
    for i, (inputs, labels) in zip(range(8), dataset(tokenizer, question=question)):
        task = TASKS[i % len(TASKS)]
        assert inputs["input"].shape == labels.shape == (SEQ_LEN,)
        _, sample = fit_sample(task, random.Random(f"0-train-{i}"), tokenizer, SEQ_LEN + 1 - MAX_ANSWER_TOKENS)
        query = question_start(inputs["positions"])
        if question == "continue":
            assert query == 0 and torch.equal(inputs["positions"], torch.arange(SEQ_LEN))
            whole = tokenizer.encode(sample.context + sample.query + " " * (task != "kv_retrieval")
                                     + " ".join(sample.answers), add_bos=True, add_eos=True)
            assert inputs["input"][:len(whole)].tolist() == whole
        else:
            context = tokenizer.encode(sample.context, add_bos=True, add_eos=False)
            assert query == len(context) and inputs["input"][:query].tolist() == context
            assert torch.equal(inputs["positions"], torch.cat([torch.arange(query), torch.arange(SEQ_LEN - query)]))
            asked = tokenizer.encode(sample.query, add_bos=False, add_eos=False)[:-1]  # the last may merge
            assert inputs["input"][query:query + len(asked)].tolist() == asked
        kept = labels != IGNORE_INDEX
        first = int(kept.nonzero()[0])
        assert kept[first:].sum() == kept.sum() and first > SEQ_LEN // 2  # one contiguous answer after a long context
        answer = labels[kept].tolist()
        assert answer[-1] == tokenizer.eos_id
        assert torch.equal(inputs["input"][first + 1: first + len(answer)], labels[first: first + len(answer) - 1])
        text = tokenizer.decode(answer[:-1])
        assert text.strip() == " ".join(sample.answers)  # the generator's answer, which the eval scores
        assert score(task, text, sample.answers) == 1.0
        assert tokenizer.decode(inputs["input"][1: first + 1].tolist()).startswith(sample.context[:50])


def test_ranks_split_the_one_process_stream_and_resume(tokenizer):
    single = [labels for _, (_, labels) in zip(range(6), dataset(tokenizer))]
    for rank in (0, 1):
        shard = [labels for _, (_, labels) in zip(range(3), dataset(tokenizer, rank=rank, world=2))]
        assert all(torch.equal(a, b) for a, b in zip(shard, single[rank::2]))
    first = dataset(tokenizer)
    it = iter(first)
    [next(it) for _ in range(3)]
    resumed = dataset(tokenizer)
    resumed.load_state_dict(first.state_dict())
    assert torch.equal(next(iter(resumed))[1], single[3])


def test_validation_is_another_finite_draw(tokenizer):
    train = [inputs["input"] for _, (inputs, _) in zip(range(4), dataset(tokenizer))]
    held = [inputs["input"] for inputs, _ in dataset(tokenizer, validation=True, infinite=False)]
    assert len(held) == 8 and not any(torch.equal(a, b) for a in train for b in held)


def test_the_dataloader_batches_and_bad_tasks_are_refused(tokenizer):
    loader = TaskDataLoader(TaskDataLoader.Config(tasks="kv_retrieval,s_niah"), dp_world_size=1, dp_rank=0,
                            tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=2)
    inputs, labels = next(iter(loader))
    assert inputs["input"].shape == labels.shape == (2, SEQ_LEN)
    with pytest.raises(UserError, match=r"unknown task\(s\) \['babilong'\]"):
        dataset(tokenizer, tasks=["babilong"])
    for options, message in (({"question": "after"}, "unknown task question 'after'"),
                             ({"question": "continue", "split_context": True}, "drop split_context or pass question"),
                             ({"haystack": "essays"}, "unknown haystack 'essays'")):
        with pytest.raises(UserError, match=message):
            dataset(tokenizer, **options)


@pytest.mark.slow
def test_a_finetune_on_the_tasks_trains_and_validates_through_torchtitan(tokenizer_dir, tmp_path):
    from conftest import train

    run = train(["--module", "train_configs.backbone", "--config", "memoryllama_alma_debug_tasks", "--training.steps",
                 "6", "--validator.freq", "3", "--checkpoint.interval", "6", "--dump_folder", str(tmp_path)])
    assert run.returncode == 0, run
    assert run.losses[6] < run.losses[1]  # the answers' loss (about ln 4096 at the start) falls
    assert run.output.count("validate step:") >= 2  # the held-out answers are scored


def test_sample_lengths_drawn_from_a_list_pad_to_the_sequence(tokenizer):
    """MoNe's 2..8 segments at a tiny scale: every sample fits its drawn length, each length
    occurs, the rest is padding without labels; a length past seq_len is refused."""
    lengths = (192, 224, SEQ_LEN)
    data = TaskDataset(list(TASKS), tokenizer, SEQ_LEN, seed=0, validation=False, infinite=True, samples=8,
                       dp_rank=0, dp_world_size=1, lengths=lengths)
    used = []
    for _, (inputs, labels) in zip(range(24), data):
        assert inputs["input"].shape == labels.shape == (SEQ_LEN,)
        last = int((labels != IGNORE_INDEX).nonzero()[-1])  # the EOS label: the sample's last token
        used.append(min(n for n in lengths if n >= last + 1))
        assert (inputs["input"][last + 1:] == tokenizer.eos_id).all()
    assert set(used) == set(lengths)
    with pytest.raises(UserError, match=r"task sample lengths \[300\] must lie in"):
        TaskDataset(list(TASKS), tokenizer, SEQ_LEN, seed=0, validation=False, infinite=True, samples=8,
                    dp_rank=0, dp_world_size=1, lengths=(300,))


def perturbed_logits(model, inputs: dict, where: list[int]) -> torch.Tensor:
    """Logits (1 + len(where), L, vocab) of a row read as the trainer reads it (tokens and
    positions), then of the row with token w changed, for each w of `where`, in one batch."""
    tokens = inputs["input"].repeat(1 + len(where), 1)
    for row, w in enumerate(where, 1):
        tokens[row, w] = (tokens[row, w] + 1) % model.cfg.vocab_size
    with torch.no_grad():
        return model(tokens, inputs["positions"].expand_as(tokens))


def test_the_question_reads_the_context_only_through_the_memory(tokenizer):
    """Default rows through a random MoNe model (segments of 16, the contexts not segment
    multiples): with writes disabled (lr = softplus(-800) = 0), changing any context token
    (the first, one inside, the last, which shares a segment with the question under
    "continue") leaves every question and answer logit exactly unchanged; with writes on,
    each changes them. Under "continue" the last context token reaches the question's
    logits with writes disabled: it is read directly."""
    from test_mone import awaken, tiny

    model = awaken(tiny(segment=16, vocab=tokenizer.get_vocab_size()))
    unwritten = awaken(tiny(segment=16, vocab=tokenizer.get_vocab_size()))
    for block in unwritten.layers.values():
        block.memory_lr.bias.data.fill_(-800.0)
    rows = TaskDataset(["s_niah", "mk_niah"], tokenizer, 160, seed=0, validation=False, infinite=True, samples=8,
                       dp_rank=0, dp_world_size=1)
    for _, (inputs, _) in zip(range(2), rows):
        query = question_start(inputs["positions"])
        assert query > 16 and query % 16  # a short last context segment
        where = [1, query // 2, query - 1]
        logits = perturbed_logits(unwritten, inputs, where)
        assert all(torch.equal(logits[0, query:], changed) for changed in logits[1:, query:])
        logits = perturbed_logits(model, inputs, where)
        assert (logits[1:, query:] - logits[:1, query:]).abs().amax(-1).min() > 1e-9
    checked = 0
    for i, (inputs, _) in zip(range(4), dataset(tokenizer, tasks=["s_niah"], question="continue")):
        _, sample = fit_sample("s_niah", random.Random(f"0-train-{i}"), tokenizer, SEQ_LEN + 1 - MAX_ANSWER_TOKENS)
        query = len(tokenizer.encode(sample.context, add_bos=True, add_eos=False))
        if query % 16:  # the context's last token shares the question's segment
            logits = perturbed_logits(unwritten, inputs, [query - 1])
            assert (logits[1, query:] - logits[0, query:]).abs().max() > 1e-6
            checked += 1
            break
    assert checked


def test_a_length_too_short_for_a_task_is_refused_when_the_rows_are_built(tokenizer):
    with pytest.raises(UserError, match="task sample length 64 cannot hold a s_niah sample"):
        TaskDataset(["s_niah"], tokenizer, 160, seed=0, validation=False, infinite=True, samples=8,
                    dp_rank=0, dp_world_size=1, lengths=(64, 160))
    rows = TaskDataset(["s_niah"], tokenizer, 160, seed=0, validation=False, infinite=True, samples=8,
                       dp_rank=0, dp_world_size=1, lengths=(96, 160))
    assert all(rows.sample(i)[0]["input"].shape == (160,) for i in range(4))


@pytest.mark.parametrize("question", ["new_segment", "continue"])
def test_row_labels_are_every_next_token_of_the_sample_and_the_answer_labels_a_part_of_them(tokenizer, question):
    """labels="row" (the in-house backbone's pretraining): the next token of every position of
    the sample up to EOS, except across a "new_segment" row's two documents; padding
    ignored; the answer labels of labels="answer" are the same ids at the same places."""
    answer_rows = dataset(tokenizer, tasks=["s_niah", "kv_retrieval"], question=question)
    row_rows = dataset(tokenizer, tasks=["s_niah", "kv_retrieval"], question=question, labels="row")
    for _, (inputs, answer), (same_inputs, row) in zip(range(4), answer_rows, row_rows):
        assert torch.equal(inputs["input"], same_inputs["input"])
        kept = row != IGNORE_INDEX
        end = int(kept.nonzero()[-1]) + 1  # the position that predicts EOS, plus one
        assert row[end - 1] == tokenizer.eos_id and not kept[end:].any()
        query = question_start(inputs["positions"])
        expected = inputs["input"][1:end].clone()
        if query:
            expected[query - 1] = IGNORE_INDEX
        assert torch.equal(row[:end - 1], expected)
        on_answer = answer != IGNORE_INDEX
        assert on_answer.sum() < kept.sum() // 4 and torch.equal(row[on_answer], answer[on_answer])


def test_unknown_task_labels_name_the_choices(tokenizer):
    with pytest.raises(UserError, match=r"unknown task labels 'all'.*'answer', 'row'"):
        dataset(tokenizer, labels="all")
