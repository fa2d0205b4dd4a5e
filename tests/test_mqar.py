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


@pytest.mark.parametrize("reach", [2, 8, 14])
def test_the_loss_reach_keeps_exactly_the_queries_within_it(reach):
    """`within_reach` on a mix of 2, 4 and 8 pairs keeps a query's target iff its key's pair lies
    <= `reach` tokens back, the distance found here by looking the key up among the pairs."""
    tasks = tuple(mqar.Task(seq_len=32, num_kv=kv, vocab=64) for kv in (2, 4, 8))
    inputs, targets = mqar.mixed_batch(tasks, 48, torch.Generator().manual_seed(3))
    kept = mqar.within_reach(inputs, targets, reach)
    near = far = 0
    for row_in, row_target, row_kept in zip(inputs.tolist(), targets.tolist(), kept.tolist()):
        kv = sum(t != mqar.IGNORE for t in row_target)
        keys = row_in[0:2 * kv:2]
        for q, (target, left) in enumerate(zip(row_target, row_kept)):
            if target == mqar.IGNORE:
                assert left == mqar.IGNORE
                continue
            within = q - 2 * keys.index(row_in[q]) <= reach
            assert left == (target if within else mqar.IGNORE), (q, reach)
            near, far = near + within, far + (not within)
    assert near > 0 and far > 0  # both sides present: the check has teeth


def test_a_loss_reach_below_every_distance_leaves_no_query_and_stops_the_run():
    """Every pair lies >= 2 tokens before its query, so a reach of 1 asks nothing: the loss is
    NaN and the run stops as non-finite at its first step (the reach reaches the loss)."""
    model = mqar.build_model("transformer", dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=32)
    task = mqar.Task(seq_len=16, num_kv=2, vocab=32)
    assert mqar.train(model, task, steps=3, batch_size=8, eval_every=3, loss_reach=8).nonfinite_step is None
    assert mqar.train(model, task, steps=3, batch_size=2, loss_reach=1).nonfinite_step == 1


@pytest.mark.parametrize("reach, reach_steps, asked_within", [(0, 0, 0), (8, 0, 4), (8, 2, 2)])
def test_the_loss_reach_applies_on_its_first_steps_only(monkeypatch, reach, reach_steps, asked_within):
    """A curriculum: `loss_reach_steps` S > 0 masks the targets on steps 1..S and asks every
    query after them; 0 masks every step; no reach masks none (4 steps here)."""
    calls = []
    monkeypatch.setattr(mqar, "within_reach", lambda inputs, targets, r: calls.append(r) or targets)
    model = mqar.build_model("transformer", dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=32)
    mqar.train(model, mqar.Task(seq_len=16, num_kv=2, vocab=32), steps=4, batch_size=2, eval_every=4, loss_reach=reach,
               loss_reach_steps=reach_steps)
    assert calls == [reach] * asked_within


def test_training_stops_at_the_first_nonfinite_step():
    model = mqar.build_model("titans_lmm", dim=32, n_layers=1, n_heads=2, vocab_size=64, window=16)
    with torch.no_grad():
        next(model.parameters()).fill_(math.inf)
    run = mqar.train(model, mqar.Task(seq_len=32, num_kv=2, vocab=64), steps=5, batch_size=4)
    assert run.nonfinite_step == 1 and run.curve == [] and run.stop == "non-finite"


def test_the_plateau_rule_names_the_target_a_flat_window_or_nothing():
    rule = mqar.Plateau(target=0.99, gain=0.01, window=3)
    assert rule.reason([0.2, 0.995]) == "target"
    assert rule.reason([0.2, 0.5, 0.505, 0.51]) is None  # 3 evaluations, but none before them to compare
    assert rule.reason([0.2, 0.5, 0.505, 0.51, 0.5]) == "plateau"  # best of the last 3 (0.51) <= 0.5 + 0.01
    assert rule.reason([0.2, 0.5, 0.505, 0.52, 0.5]) is None  # 0.52 is a gain above 0.01
    assert rule.reason([0.6, 0.3, 0.3, 0.3]) == "plateau"  # a fall is no gain
    with pytest.raises(ValueError, match="window >= 1"):
        mqar.Plateau(window=0)


@pytest.mark.parametrize("scores, stop, steps", [
    ([0.1, 0.4, 0.995, 0.2], "target", 6),  # the evaluation at step 6 reaches 0.99
    ([0.1, 0.3, 0.305, 0.3, 0.308, 0.9], "plateau", 10),  # steps 4-10: no gain above 0.01 on 0.3
    ([0.1, 0.2, 0.3, 0.4], "cap", 8),  # gaining to the last step
])
def test_training_to_the_plateau_stops_where_the_rule_says(scores, stop, steps):
    """`train` with a scripted evaluation every 2 steps (its accuracies `scores`) and cap 8
    steps: it stops after the evaluation the rule names, and the curve ends there."""
    model = mqar.build_model("transformer", dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=32)
    script = iter(scores)
    run = mqar.train(model, mqar.Task(seq_len=16, num_kv=2, vocab=32), steps=8 if stop == "cap" else 12, batch_size=2,
                     eval_every=2, evaluate=lambda m: next(script), until=mqar.Plateau(window=3))
    assert run.stop == stop and run.curve[-1][0] == steps and [a for _, a in run.curve] == scores[:steps // 2]


def test_a_snapshot_of_another_run_is_not_loaded(tmp_path):
    """A snapshot file whose key names another run (another rate here) leaves the model and the
    optimizer as they are and gives a fresh Run."""
    model = mqar.build_model("transformer", dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=32)
    task = mqar.Task(seq_len=16, num_kv=2, vocab=32)
    mqar.train(model, task, steps=4, batch_size=2, eval_every=2, snapshot=mqar.Snapshot(tmp_path / "s.pt", {"lr": 1e-3}))
    assert torch.load(tmp_path / "s.pt", weights_only=False)["step"] == 2  # written after the evaluation that did not stop it
    fresh = mqar.build_model("transformer", dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=32)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    optimizer = torch.optim.AdamW(fresh.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    done, run = mqar.Snapshot(tmp_path / "s.pt", {"lr": 3e-3}).load(fresh, optimizer, schedule, torch.Generator())
    assert (done, run.curve) == (0, []) and not optimizer.state
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
