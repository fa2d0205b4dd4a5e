"""MQAR (torchtitan_ext/eval/mqar.py): Zoology's generator rules, and the training loop's
recall measurement and non-finite stop."""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan_ext.eval import mqar


def test_pairs_then_each_key_asked_once_with_its_value():
    task = mqar.Task(seq_len=64, num_kv=4, vocab=256)
    inputs, targets = mqar.batch(task, 32, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (32, 64)
    half = task.vocab // 2
    for row_in, row_target in zip(inputs.tolist(), targets.tolist()):
        keys, values = row_in[0:8:2], row_in[1:8:2]
        assert len(set(keys)) == 4 and all(k < half for k in keys) and all(v >= half for v in values)
        answers = [(t, row_target[t]) for t in range(64) if row_target[t] != mqar.IGNORE]
        assert len(answers) == 4  # every pair re-asked exactly once, after the pairs
        for position, value in answers:
            assert position >= 8 and value == values[keys.index(row_in[position])]  # the asked key's value
        # the target of an answer is the next input token (next-token prediction)
        assert all(row_in[p + 1] == v for p, v in answers if p + 1 < 64)


def test_queries_come_mostly_soon_after_the_pairs():
    task = mqar.Task(seq_len=256, num_kv=8)
    _, targets = mqar.batch(task, 256, torch.Generator().manual_seed(1))
    positions = (targets != mqar.IGNORE).nonzero()[:, 1].float()
    first_half = (positions < 16 + (256 - 16) / 2).float().mean().item()
    assert first_half > 0.6  # power law (power_a 0.01): early slots more likely than late ones


def test_bad_task_is_refused():
    with pytest.raises(ValueError, match="need at least"):
        mqar.Task(seq_len=16, num_kv=8)


def test_a_model_that_only_knows_the_pairs_scores_1_and_chance_is_low():
    """accuracy() on a stand-in model that answers by looking the key up in the pairs: 1.0;
    on one that answers a fixed value token: at chance."""
    task = mqar.Task()
    inputs, targets = mqar.batch(task, 64, torch.Generator().manual_seed(2))

    class LookUp(torch.nn.Module):
        def forward(self, tokens):
            logits = torch.zeros(*tokens.shape, task.vocab)
            for b in range(tokens.shape[0]):
                pairs = dict(zip(tokens[b, 0:8:2].tolist(), tokens[b, 1:8:2].tolist()))
                for t in range(8, tokens.shape[1]):
                    logits[b, t, pairs.get(tokens[b, t].item(), 0)] = 1.0
            return logits

    class Constant(torch.nn.Module):
        def forward(self, tokens):
            logits = torch.zeros(*tokens.shape, task.vocab)
            logits[..., task.vocab - 1] = 1.0
            return logits

    assert mqar.accuracy(LookUp(), inputs, targets) == 1.0
    assert mqar.accuracy(Constant(), inputs, targets) < 0.05


def test_training_stops_at_the_first_nonfinite_step():
    model = mqar.build_model("titans_lmm", dim=32, n_layers=1, n_heads=2, vocab_size=64, window=16)
    with torch.no_grad():
        next(model.parameters()).fill_(math.inf)
    run = mqar.train(model, mqar.Task(seq_len=32, num_kv=2, vocab=64), steps=5, batch_size=4)
    assert run.nonfinite_step == 1 and run.curve == []
