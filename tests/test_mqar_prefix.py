"""The prefix study (torchtitan_ext/eval/mqar_prefix.py, scripts/mqar_prefix.py): the wrapper
is a model reading one extra token, causal; runs are recorded, resumed, and bad input exits 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan_ext.eval import mqar_prefix, mqar_suite

QUICK = mqar_suite.SETTINGS["quick"]
ROOT = Path(__file__).resolve().parents[1]


def test_the_prefix_is_one_more_vocabulary_token():
    """PrefixLM(transformer) equals the same transformer with one more vocabulary token whose
    embedding row is the prefix, fed that token first (no hook involved): the wrapper adds a
    learned first token and nothing else."""
    torch.manual_seed(0)
    vocab = QUICK.vocab
    wrapped = mqar_prefix.PrefixLM(mqar_suite.build_row("transformer_full", QUICK), QUICK.width, 0.5).eval()
    wider = mqar_suite.build_row("transformer_full", QUICK, vocab_size=vocab + 1).eval()
    state = {k: v for k, v in wrapped.inner.state_dict().items() if k not in ("tok_embeddings.weight", "lm_head.weight")}
    wider.load_state_dict(state, strict=False)
    with torch.no_grad():
        wider.tok_embeddings.weight[:vocab] = wrapped.inner.tok_embeddings.weight
        wider.tok_embeddings.weight[vocab] = wrapped.prefix[0, 0]
        wider.lm_head.weight[:vocab] = wrapped.inner.lm_head.weight
    tokens = torch.randint(0, vocab, (3, 12), generator=torch.Generator().manual_seed(1))
    extra = torch.full((3, 1), vocab)
    with torch.no_grad():
        expected = mqar_suite.mqar.logits_of(wider, torch.cat([extra, tokens], 1))[:, 1:, :vocab]
        got = wrapped(tokens)
    assert got.shape == (3, 12, vocab)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        wrapped.prefix.add_(1.0)
        assert (wrapped(tokens) - got).abs().max() > 1e-3  # the prefix is read


def test_the_prefixed_model_is_causal_and_trains_its_prefix():
    torch.manual_seed(0)
    model = mqar_prefix.PrefixLM(mqar_suite.build_row("mlp_lm", QUICK), QUICK.width, 0.02)
    tokens = torch.randint(0, QUICK.vocab, (2, 16), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % QUICK.vocab
    out, out_changed = model(tokens), model(changed)
    assert torch.equal(out[:, :9], out_changed[:, :9])
    assert (out[:, 9:] - out_changed[:, 9:]).abs().max() > 1e-4
    out.square().mean().backward()
    assert model.prefix.grad is not None and model.prefix.grad.abs().sum() > 0


def test_runs_are_recorded_once_each(tmp_path):
    out = tmp_path / "runs.jsonl"
    first = mqar_prefix.run_all("transformer_full", QUICK, [0, 1], 3e-3, 0.02, {}, out, log=lambda line: None)
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and [json.loads(line)["seed"] for line in lines] == [0, 1]
    plain = mqar_prefix.run("transformer_full", QUICK, 0, 3e-3, None)
    assert first[0]["parameters"] == plain["parameters"] + QUICK.width  # the prefix vector, nothing else
    assert first[0]["curve"][-1][0] == first[0]["stop_step"] <= QUICK.max_steps() and first[0]["stop"] != "non-finite"
    again = mqar_prefix.run_all("transformer_full", QUICK, [1, 2], 3e-3, 0.02, {}, out, log=lambda line: None)
    assert again[0] == first[1]  # seed 1 read back, not retrained
    assert len(out.read_text().splitlines()) == 3
    fewer_prompts = mqar_prefix.setting_with(True, val_prompts=2)
    changed = mqar_prefix.run_all("transformer_full", fewer_prompts, [1], 3e-3, 0.02, {}, out, log=lambda line: None)
    assert changed[0]["setting_changes"] == {"val_prompts": 2}  # another setting: a run of its own
    assert sum(changed[0]["within_window"][1:] + changed[0]["beyond_window"][1:]) == 2 * sum(QUICK.train_kv)
    assert changed[0]["within_window_by_kv"]["2"] == changed[0]["within_window"]  # one training task: the same
    assert len(out.read_text().splitlines()) == 4
    reached = mqar_prefix.run_all("transformer_full", fewer_prompts, [1], 3e-3, 0.02, {}, out, log=lambda line: None,
                                  loss_reach=6)
    assert reached[0]["loss_reach"] == 6 and len(out.read_text().splitlines()) == 5  # another reach: a run of its own


@pytest.mark.parametrize("args, message", [
    (["--row", "nope"], "unknown row 'nope'"),
    ([], "--row is needed"),
    (["--summary"], "does not exist"),
    (["--row", "mlp_lm", "--set", "bogus=1"], "refuses ['bogus']"),
    (["--row", "mlp_lm", "--seeds", "a-b"], "--seeds 'a-b'"),
    (["--row", "mela", "--setting", "mela_span=9"], "must equal mela_span 9"),
    (["--row", "mela", "--setting", "nope=1"], "unexpected keyword argument 'nope'"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, message):
    out = tmp_path / "runs.jsonl"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "mqar_prefix.py"), "--quick", "--out", str(out), *args],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_summary_pairs_each_prefixed_setting_with_the_plain_one():
    """3 of 3 plain runs solved, 0 of 3 prefixed: of the C(6, 3) = 20 equally likely ways to
    place the 3 successes, only one puts all in the plain group, so p = 1/20."""
    def record(std, seed, accuracy, steps=900):
        return {"row": "mlp_lm", "steps": steps, "lr": 3e-3, "overrides": {}, "prefix_std": std, "seed": seed,
                "val_accuracy": accuracy, "solved": accuracy >= mqar_prefix.SOLVED}

    records = [record(None, s, 0.95) for s in range(3)] + [record(0.02, s, 0.3) for s in range(3)]
    records.append(record(0.02, 0, 0.99, steps=2700))  # no plain line at 2700 steps: no p
    lines = mqar_prefix.summary(records).splitlines()
    assert len(lines) == 2 + 3
    plain, prefixed, longer = lines[2:]
    assert "| none | 0: 0.95, 1: 0.95, 2: 0.95 | 3 of 3 | - |" in plain
    assert "| 0.02 | 0: 0.30, 1: 0.30, 2: 0.30 | 0 of 3 | 0.05 |" in prefixed
    assert longer.startswith("| mlp_lm | 2700 |") and longer.endswith("| 1 of 1 | - |")


def test_validation_queries_split_at_the_window():
    """A stand-in that answers every query right: all of them counted, split by the pair's
    distance, both sides non-empty at the quick setting (so the split has teeth)."""
    class Oracle(torch.nn.Module):
        def forward(self, tokens):
            logits = torch.zeros(*tokens.shape, QUICK.vocab)
            for b in range(tokens.shape[0]):
                for t in range(1, tokens.shape[1]):
                    earlier = (tokens[b, :t - 1:2] == tokens[b, t]).nonzero()
                    if t % 2 == 1 or len(earlier) == 0:
                        continue
                    logits[b, t, tokens[b, 2 * earlier[0, 0] + 1]] = 1.0
            return logits

    profile = mqar_prefix.validation_by_distance(Oracle(), QUICK, seed=0)
    assert set(profile) == {str(kv) for kv in QUICK.train_kv}
    inside, beyond = mqar_prefix.split_at(QUICK.window, *profile.values())
    queries = sum(kv * QUICK.val_prompts for kv in QUICK.train_kv)
    assert inside[1] + beyond[1] == queries and inside[1] > 0 and beyond[1] > 0
    assert inside[0] == inside[1] and beyond[0] == beyond[1]
    near = mqar_prefix.split_at(4, *profile.values())[0]
    assert 0 < near[1] < inside[1]  # the split moves with the window
