"""The MQAR suite (torchtitan_ext/eval/mqar_suite.py): per-query outcomes, prompts drawn per
seed, the window-only Transformer++'s mask, the verdict rule on constructed items, and the
hypotheses' scopes. The suite end to end (--quick) and the verdicts rebuilt from its JSON:
tests/test_leaderboard.py::test_verdicts_from_json."""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib

import pytest
import torch

from torchtitan_ext.eval import mqar, mqar_suite, mqar_verdicts
from torchtitan_ext.training.cpu import flushing_denormals

QUICK = mqar_suite.SETTINGS["quick"]


def test_mixed_batch_splits_the_batch_over_the_settings():
    tasks = (mqar.Task(seq_len=32, num_kv=2, vocab=64), mqar.Task(seq_len=32, num_kv=4, vocab=64))
    inputs, targets = mqar.mixed_batch(tasks, 5, torch.Generator().manual_seed(0))
    assert inputs.shape == (5, 32)
    assert (targets != mqar.IGNORE).sum(1).tolist() == [2, 2, 2, 4, 4]
    with pytest.raises(ValueError, match="one sequence length"):
        mqar.mixed_batch((tasks[0], mqar.Task(seq_len=64, num_kv=2, vocab=64)), 4, torch.Generator())


def test_answers_gives_each_querys_outcome_and_its_distance_to_the_pair():
    """A stand-in model that answers only keys whose pair lies within 20 tokens: its per-query
    outcomes match that rule through the distances `answers` reports."""
    task = mqar.Task(seq_len=64, num_kv=4, vocab=64)
    inputs, targets = mqar.batch(task, 16, torch.Generator().manual_seed(3))

    class Near(torch.nn.Module):
        def forward(self, tokens):
            logits = torch.zeros(*tokens.shape, task.vocab)
            for b in range(tokens.shape[0]):
                keys = tokens[b, 0:8:2].tolist()
                for t in range(8, tokens.shape[1]):
                    key = tokens[b, t].item()
                    if key in keys and t - 2 * keys.index(key) <= 20:
                        logits[b, t, tokens[b, 2 * keys.index(key) + 1]] = 1.0
            return logits

    correct, distance = mqar.answers(Near(), inputs, targets)
    assert correct.shape == distance.shape == (16, 4)
    assert (distance >= 8 - 6).all()  # a query comes after every pair
    assert torch.equal(correct, distance <= 20)
    assert 0 < correct.float().mean() < 1  # both kinds occur, so the check has teeth


def test_prompts_are_drawn_per_seed_and_split_and_repeat_within_one():
    a = mqar_suite.prompts(QUICK, 2, 16, 6, 0, "test")[0]
    assert torch.equal(a, mqar_suite.prompts(QUICK, 2, 16, 6, 0, "test")[0])
    assert not torch.equal(a, mqar_suite.prompts(QUICK, 2, 16, 6, 1, "test")[0])
    assert not torch.equal(a, mqar_suite.prompts(QUICK, 2, 16, 6, 0, "validation")[0])


@pytest.mark.parametrize("row", ["transformer_window", "transformer_window_reach"])
def test_the_window_only_transformer_sees_only_its_window(row):
    """Same weights, full vs windowed attention: equal logits up to the window, different after
    (the reach-trained control is the same model)."""
    s = dataclasses.replace(QUICK, window=8)
    torch.manual_seed(0)
    full = mqar_suite.build_row("transformer_full", s).eval()
    windowed = mqar_suite.build_row(row, s).eval()
    windowed.load_state_dict(full.state_dict())
    tokens = torch.randint(0, s.vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = mqar.logits_of(full, tokens), mqar.logits_of(windowed, tokens)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert (a[:, 8:] - b[:, 8:]).abs().amax() > 1e-4
    changed = tokens.clone()
    changed[:, 0] = (changed[:, 0] + 1) % s.vocab  # outside every window after 2 layers x 8 tokens
    with torch.no_grad():
        torch.testing.assert_close(mqar.logits_of(windowed, changed)[:, 16:], b[:, 16:])


def test_the_reach_control_is_the_window_only_model_asked_what_its_windows_reach(monkeypatch):
    """`transformer_window_reach` (windowed as `transformer_window`: the test above) has its loss
    asked within layers x (window - 1) tokens on every step; the other rows ask every query."""
    calls = []
    real = mqar.within_reach
    monkeypatch.setattr(mqar, "within_reach", lambda inputs, targets, r: calls.append(r) or real(inputs, targets, r))
    _, record = mqar_suite.train_run("transformer_window_reach", QUICK, 0, 3e-3)
    assert calls == [QUICK.layers * (QUICK.window - 1)] * record["stop_step"] and calls
    calls.clear()
    mqar_suite.train_run("transformer_window", QUICK, 0, 3e-3)
    assert calls == []


def test_every_row_builds_at_one_width_and_depth():
    for name in mqar_suite.ROWS:
        family, fields = mqar_suite.row_spec(name, QUICK)
        assert (fields["dim"], fields["n_layers"]) == (QUICK.width, QUICK.layers), name
    assert mqar_suite.row_spec("mela_memory_off", QUICK)[1]["memory_path"] is False
    assert mqar_suite.row_spec("mela", QUICK)[1]["memory_path"] is True
    with pytest.raises(ValueError, match="unknown MQAR row"):
        mqar_suite.row_spec("rwkv", QUICK)


def _results(model_items, control_items, hypothesis, length=16):
    """A results dict holding two rows with the given per-seed per-prompt outcomes on one task."""
    def row(items):
        return {"seeds": {str(i): {"tasks": {f"kv2_len{length}": {"kv": 2, "length": length, "correct": seed}}}
                          for i, seed in enumerate(items)}}

    return {"setting": {"train_len": 16}, "floor": mqar_suite.FLOOR, "hypotheses": [hypothesis],
            "rows": {"a": row(model_items), "b": row(control_items)}}


BETTER = dict(key="T", claim="a beats b", model="a", control="b", metric="accuracy_difference", sense="better",
              tolerance=0.02, smallest_effect=0.1, expected_width=0.2, threshold=None, lengths="all", why="")


def test_a_clear_paired_gain_is_supported_and_a_clear_null_is_not():
    gain = _results([[[1, 1]] * 20] * 3, [[[0, 1]] * 20] * 3, BETTER)  # +0.5 on every prompt of every seed
    (v,) = mqar_verdicts.verdicts(gain)
    assert v["verdict"] == "supported" and v["estimate"] == pytest.approx(0.5)
    null = _results([[[0, 1]] * 20] * 3, [[[0, 1]] * 20] * 3, BETTER)  # both 0.5: difference exactly 0
    (v,) = mqar_verdicts.verdicts(null)
    assert v["verdict"] == "not supported" and v["ci95"] == [0.0, 0.0]


def test_a_noisy_small_difference_is_inconclusive_and_both_rows_at_zero_is_at_floor():
    generator = torch.Generator().manual_seed(0)
    noisy_model = [torch.randint(0, 2, (8, 2), generator=generator).tolist() for _ in range(2)]
    noisy_control = [torch.randint(0, 2, (8, 2), generator=generator).tolist() for _ in range(2)]
    (v,) = mqar_verdicts.verdicts(_results(noisy_model, noisy_control, BETTER))
    assert v["verdict"] == "inconclusive" and v["ci_width"] > 0.2
    (v,) = mqar_verdicts.verdicts(_results([[[0, 0]] * 5] * 2, [[[0, 0]] * 5] * 2, BETTER))
    assert v["verdict"] == "at floor (task)"


def test_at_least_uses_its_threshold_minus_tolerance():
    h = dict(BETTER, control=None, metric="accuracy", sense="at_least", threshold=0.9, tolerance=0.05, lengths="trained")
    assert mqar_verdicts.verdict(h, (0.86, 0.95)) == "supported"
    assert mqar_verdicts.verdict(h, (0.70, 0.84)) == "not supported"
    assert mqar_verdicts.verdict(h, (0.80, 0.95)) == "inconclusive"
    (v,) = mqar_verdicts.verdicts(_results([[[1, 1]] * 10] * 2, [[[0, 0]] * 10] * 2, h))
    assert v["verdict"] == "supported"


def test_a_hypothesis_answers_only_the_tasks_in_its_scope():
    results = _results([[[1, 1]] * 4] * 2, [[[0, 1]] * 4] * 2, dict(BETTER, lengths="past"))
    assert mqar_verdicts.verdicts(results) == []  # the only task is at the trained length
    longer = _results([[[1, 1]] * 4] * 2, [[[0, 1]] * 4] * 2, dict(BETTER, lengths="past"), length=32)
    assert [v["task"] for v in mqar_verdicts.verdicts(longer)] == ["kv2_len32"]


def test_the_hypotheses_name_rows_of_the_suite_and_state_their_numbers():
    for h in mqar_suite.HYPOTHESES:
        assert h.model in mqar_suite.ROWS and (h.control is None or h.control in mqar_suite.ROWS), h.key
        assert h.expected_width > 0 and h.tolerance >= 0, h.key
        assert (h.sense in ("at_least", "fewer")) == (h.threshold is not None), h.key
        assert (h.sense == "fewer") == (h.metric == "flops_to_level"), h.key
        assert h.metric != "flops_to_level" or h.threshold in mqar_verdicts.LEVELS, h.key  # the runs' reach levels
        assert h.sense != "fewer" or h.control is not None, h.key
        assert h.sense == "at_least" or h.smallest_effect > h.tolerance, h.key
    assert len({h.key for h in mqar_suite.HYPOTHESES}) == len(mqar_suite.HYPOTHESES)


def _reaching(flops_by_seed: dict) -> dict:
    """A row whose seeds reached validation 0.8 after the given training FLOPs (None: never)."""
    return {"seeds": {seed: {"reach": {"0.8": None if f is None else {"step": 1, "train_flops": f}}}
                      for seed, f in flops_by_seed.items()}}


FEWER = dict(BETTER, metric="flops_to_level", sense="fewer", tolerance=0.0, smallest_effect=0.32, threshold=0.8)


def test_sample_efficiency_is_the_median_log2_flops_ratio_over_seeds_either_row_reached():
    """Half the FLOPs on every seed: gain 1 (log2), supported; equal FLOPs: 0, not supported; a
    seed only the model reached counts as +inf, one neither reached is left out; no seed where
    either reached: no verdict."""
    v = mqar_verdicts.efficiency_verdict(FEWER, _reaching({"0": 1.0, "1": 2.0, "2": 3.0}),
                                         _reaching({"0": 2.0, "1": 4.0, "2": 6.0}))
    assert v["verdict"] == "supported" and v["estimate"] == pytest.approx(1.0) and v["ci95"] == pytest.approx([1.0, 1.0])
    v = mqar_verdicts.efficiency_verdict(FEWER, _reaching({"0": 2.0, "1": 4.0, "2": 6.0}),
                                         _reaching({"0": 2.0, "1": 4.0, "2": 6.0}))
    assert v["verdict"] == "not supported" and v["estimate"] == 0.0
    gains = mqar_verdicts.level_gains(_reaching({"0": 1.0, "1": 1.0, "2": None, "3": None}),
                                      _reaching({"0": None, "1": 4.0, "2": 1.0, "3": None}), 0.8)
    assert gains == [float("inf"), 2.0, float("-inf")]
    mixed = mqar_verdicts.efficiency_verdict(FEWER, _reaching({"0": 1.0, "1": 1.0, "2": None}),
                                             _reaching({"0": None, "1": 4.0, "2": 1.0}))
    assert mixed["verdict"] == "inconclusive" and mixed["paired_seeds"] == 3 and mixed["estimate"] == 2.0
    only_model = mqar_verdicts.efficiency_verdict(FEWER, _reaching({"0": 1.0, "1": 1.0}), _reaching({"0": None, "1": None}))
    assert only_model["verdict"] == "supported" and only_model["ci95"] == [float("inf")] * 2 and only_model["ci_width"] == 0
    even = mqar_verdicts.efficiency_verdict(FEWER, _reaching({"0": 1.0, "1": 1.0}), _reaching({"0": None, "1": 1.0}))
    assert even["estimate"] == 0.0  # gains (0, inf): the lower middle one
    none = mqar_verdicts.efficiency_verdict(FEWER, _reaching({"0": None}), _reaching({"0": None}))
    assert none["verdict"] == "neither reaches 0.8" and none["ci95"] is None


def test_a_setting_with_the_window_not_shorter_than_the_sequence_is_refused():
    with pytest.raises(ValueError, match="shorter than the training length"):
        dataclasses.replace(QUICK, window=16, mela_patch=4)
    assert copy.deepcopy(QUICK) == QUICK


def _window_results(control_inside_right: int, window: int = 4):
    """A model row answering every query and a window-only control answering the first
    `control_inside_right` of its 30 queries within `window` tokens and none beyond: 3 seeds x
    10 prompts of 2 queries (one at distance 2, one at 12) on one task at length 16."""
    def row(correct):  # correct(i, near) for prompt i of 30
        return {"seeds": {str(seed): {"tasks": {"kv2_len16": {
            "kv": 2, "length": 16, "distance": [[2, 12]] * 10,
            "correct": [[correct(10 * seed + i, True), correct(10 * seed + i, False)] for i in range(10)]}}}
            for seed in range(3)}}

    h = dict(BETTER, model="memory", control="transformer_window", control_inside=0.9)
    return {"setting": {"train_len": 16, "window": window}, "floor": mqar_suite.FLOOR, "hypotheses": [h],
            "rows": {"memory": row(lambda i, near: 1),
                     "transformer_window": row(lambda i, near: int(near and i < control_inside_right))}}


def test_no_control_no_verdict():
    """A window-only control answering 26 of its 30 in-window queries (0.87 < 0.9) leaves the
    hypothesis without a verdict, however large the gain; one answering 27 (0.9) gives one."""
    (v,) = mqar_verdicts.verdicts(_window_results(26))
    assert v["verdict"] == "no control (window-only control answers 0.87 inside its window < 0.9)"
    assert v["control_inside"] == pytest.approx(26 / 30) and v["estimate"] == pytest.approx(1 - 26 / 60)
    (v,) = mqar_verdicts.verdicts(_window_results(27))
    assert v["verdict"] == "supported" and v["control_inside"] == pytest.approx(0.9)
    (v,) = mqar_verdicts.verdicts(_window_results(27, window=1))  # no query within 1 token
    assert v["verdict"] == "no control (no query inside the window)" and v["control_inside"] is None
    without_rule = _window_results(0)
    without_rule["hypotheses"][0]["control_inside"] = None
    assert mqar_verdicts.verdicts(without_rule)[0]["verdict"] == "supported"


def test_queries_fall_into_the_distance_bins_by_their_pair():
    """The control of `_window_results` (pairs at 2 and 12 tokens, 27 of 30 near ones right, no
    far one) binned at a window of 8 (edges 2, 4, 6, 8, 14): the near queries in the first
    bin, the far ones in 9-14, nothing elsewhere; the inside/beyond split is the same count."""
    edges = mqar_verdicts.distance_edges(8)
    assert edges == (2, 4, 6, 8, 14) and mqar_verdicts.distance_edges(1) == (1,)
    control = _window_results(27)["rows"]["transformer_window"]
    assert mqar_verdicts.binned_counts(control, edges) == [[27, 30], [0, 0], [0, 0], [0, 0], [0, 30], [0, 0]]
    assert mqar_verdicts.binned_counts(control, edges, length=32) == [[0, 0]] * 6  # no task of that length
    assert mqar_verdicts.binned_counts(control, (2, 11)) == [[27, 30], [0, 0], [0, 30]]  # 12 > 11: the last bin
    assert mqar_verdicts.split_counts(control, 8) == {"inside": [27, 30], "beyond": [0, 30]}
    assert mqar_verdicts.split_counts(control, 12) == {"inside": [27, 60], "beyond": [0, 0]}  # d <= window is inside


def test_reach_gives_the_first_evaluation_at_each_level_in_steps_and_flops():
    curve = [[100, 0.3], [200, 0.55], [300, 0.5], [400, 0.85]]
    assert mqar_verdicts.reach(curve, tokens_per_step=1024, flops_per_token=2.0) == {
        "0.5": {"step": 200, "train_flops": 200 * 1024 * 2.0}, "0.8": {"step": 400, "train_flops": 400 * 1024 * 2.0},
        "0.99": None}


def test_the_second_shape_keeps_melas_span_apart_from_the_window():
    s = mqar_suite.SETTINGS["plateau128"]
    assert (s.train_len, s.window, s.memory_chunk, s.mela_span, s.mela_patch * s.mela_chunk) == (128, 16, 8, 64, 64)
    assert mqar_suite.row_spec("mela", s)[1]["patch_size"] * mqar_suite.row_spec("mela", s)[1]["chunk_size"] == 64
    assert mqar_suite.row_spec("titans_mac", s)[1]["window"] == 16 and s.max_steps() == 6 * s.steps
    with pytest.raises(ValueError, match="must equal mela_span 64"):
        dataclasses.replace(s, mela_chunk=4)
    assert mqar_suite.SETTINGS["full"].plateau() is None and s.plateau() == mqar.Plateau(0.99, 0.01, 20)


def test_the_plateau_settings_wait_20_evaluations_and_give_the_seed_sensitive_rows_5_seeds():
    """W1 (HYPOTHESES.md): 2,000 flat steps at both shapes; issue 48: >= 3 seeds a row, >= 5 where
    the verdict turned on the seed."""
    t32, t128 = mqar_suite.SETTINGS["plateau32"], mqar_suite.SETTINGS["plateau128"]
    assert t32.plateau_window * t32.eval_every == t128.plateau_window * t128.eval_every == 2000
    assert t32.seeds_of("transformer_full") == (0, 1, 2)
    assert all(t32.seeds_of(r) == (0, 1, 2, 3, 4)
               for r in ("mlp_lm", "titans_mac", "titans_mac_inputs", "transformer_window_reach"))
    sensitive = ("mela", "mela_memory_off", "titans_mac", "titans_mac_inputs", "mlp_lm")
    assert all(t128.seeds_of(r) == ((0, 1, 2, 3, 4) if r in sensitive else (0, 1, 2)) for r in mqar_suite.ROWS)
    assert dataclasses.replace(t32, seeds=tuple(range(6))).seeds_of("mlp_lm") == tuple(range(6))  # --seeds 6 wins


def test_a_run_made_under_another_plateau_window_is_trained_again_not_reused(tmp_path, monkeypatch):
    """The run file's setting is the cache key: more seeds reuse a run, another window does not."""
    calls = []

    def fake_run(name, s, seed, lr, build=None, snapshot=None):
        calls.append((s.plateau_window, seed, lr))
        return torch.nn.Linear(1, 1), {"seed": seed, "lr": lr, "plateau_window": s.plateau_window, "val_accuracy": 0.0,
                                       "stop_step": 1, "stop": "cap", "train_seconds": 0.0}

    monkeypatch.setattr(mqar_suite, "train_run", fake_run)
    monkeypatch.setattr(mqar_suite, "test_items", lambda model, s, seed: {})
    mqar_suite.trained("transformer_full", QUICK, 0, 1e-3, tmp_path, log=lambda line: None)
    more_seeds = dataclasses.replace(QUICK, seeds=(0, 1, 2), row_seeds=(("transformer_full", 4),))
    assert mqar_suite.trained("transformer_full", more_seeds, 0, 1e-3, tmp_path)["plateau_window"] == 2
    assert calls == [(2, 0, 1e-3)]
    longer = dataclasses.replace(QUICK, plateau_window=3)
    assert mqar_suite.runs_done("transformer_full", longer, tmp_path) == (0, 3)
    assert mqar_suite.trained("transformer_full", longer, 0, 1e-3, tmp_path, log=lambda line: None)["plateau_window"] == 3
    assert calls == [(2, 0, 1e-3), (3, 0, 1e-3)]
    assert mqar_suite.runs_done("transformer_full", longer, tmp_path) == (1, 3)
    assert mqar_suite.runs_done("transformer_full", QUICK, tmp_path) == (0, 3)  # the window-2 run was replaced


def test_a_run_killed_while_its_file_is_written_leaves_the_earlier_file(tmp_path, monkeypatch):
    """Run files are renamed into place (`paths.write_json`): a write that fails half way (here the
    disk filling up after the first bytes) leaves the earlier run of that name whole and readable."""
    def fake_run(name, s, seed, lr, build=None, snapshot=None):
        return torch.nn.Linear(1, 1), {"seed": seed, "lr": lr, "plateau_window": s.plateau_window, "stop_step": 1,
                                       "val_accuracy": 0.0, "stop": "cap", "train_seconds": 0.0}

    monkeypatch.setattr(mqar_suite, "train_run", fake_run)
    monkeypatch.setattr(mqar_suite, "test_items", lambda model, s, seed: {})
    mqar_suite.trained("transformer_full", QUICK, 0, 1e-3, tmp_path, log=lambda line: None)
    path = tmp_path / "lr0.001_seed0.json"
    earlier = path.read_text()
    real_write = pathlib.Path.write_text

    def disk_full(self, text, *args, **kwargs):
        real_write(self, text[:10], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", disk_full)
    with pytest.raises(OSError, match="No space"):
        mqar_suite.trained("transformer_full", dataclasses.replace(QUICK, plateau_window=3), 0, 1e-3, tmp_path,
                           log=lambda line: None)
    assert path.read_text() == earlier and json.loads(earlier)["record"]["plateau_window"] == 2
    assert mqar_suite.runs_done("transformer_full", QUICK, tmp_path)[0] == 1


def test_a_run_killed_after_an_evaluation_resumes_there_as_the_run_it_would_have_been(tmp_path, monkeypatch):
    """A Titans MAC run killed after its second evaluation (here: its third raises) leaves its
    snapshot; the rerun goes on from there and its record (curves, per-task curves, last loss,
    stop, test items) equals the uncut run's, and the snapshot is gone once the run file is written."""
    s = dataclasses.replace(QUICK, cap_factor=3, plateau_window=4)  # up to 6 steps, an evaluation after each
    uncut_model, uncut = mqar_suite.train_run("titans_mac", s, 0, 1e-3)
    uncut["tasks"] = mqar_suite.test_items(uncut_model, s, 0)
    real, calls = mqar_suite.validation_accuracies, []

    def killed_at_the_third(model, setting, seed):
        calls.append(seed)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(model, setting, seed)

    monkeypatch.setattr(mqar_suite, "validation_accuracies", killed_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        mqar_suite.trained("titans_mac", s, 0, 1e-3, tmp_path, log=lambda line: None)
    snapshot = tmp_path / "lr0.001_seed0.snapshot.pt"
    assert torch.load(snapshot, weights_only=False)["step"] == 2
    monkeypatch.setattr(mqar_suite, "validation_accuracies", real)
    resumed = mqar_suite.trained("titans_mac", s, 0, 1e-3, tmp_path, log=lambda line: None)
    assert not snapshot.exists() and len(uncut["curve"]) > 2
    timing = ("train_seconds", "train_tokens_per_s")
    assert {k: v for k, v in resumed.items() if k not in timing} == {k: v for k, v in uncut.items() if k not in timing}


def test_runs_trained_in_parallel_workers_equal_the_runs_trained_one_after_another(tmp_path):
    """--jobs 2: every run of the rows (the sweep, then the other seeds at the chosen rate) trains in
    one-thread worker processes, and each run file equals the one a one-thread serial suite writes."""
    rows = ("transformer_full", "mlp_lm")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        serial = mqar_suite.run_suite(QUICK, tmp_path / "serial", rows=rows, log=lambda line: None)
    finally:
        torch.set_num_threads(threads)
    mqar_suite.train_runs_in_parallel(QUICK, tmp_path / "parallel", rows, 2, print)
    for name in rows:  # every run the rows need is on disk before the suite's serial pass
        done, needed = mqar_suite.runs_done(name, QUICK, tmp_path / "parallel" / "runs" / name)
        assert done == needed > 1, name
    parallel = mqar_suite.run_suite(QUICK, tmp_path / "parallel", rows=rows, log=print, jobs=2)
    for name in rows:
        files = sorted(p.name for p in (tmp_path / "serial" / "runs" / name).glob("*.json"))
        assert len(files) == mqar_suite.runs_done(name, QUICK, tmp_path / "serial" / "runs" / name)[1], name
        assert files == sorted(p.name for p in (tmp_path / "parallel" / "runs" / name).glob("*.json")), name
        for file in files:
            one, two = (json.loads((tmp_path / kind / "runs" / name / file).read_text())["record"]
                        for kind in ("serial", "parallel"))
            assert {k: v for k, v in one.items() if "seconds" not in k and "per_s" not in k} == \
                {k: v for k, v in two.items() if "seconds" not in k and "per_s" not in k}, (name, file)
    assert parallel["summary"] == serial["summary"] and parallel["verdicts"] == serial["verdicts"]


def test_batches_of_rows_add_up_and_a_row_not_run_is_listed_not_dropped(tmp_path):
    """Two batches into one folder: the second report holds the first batch's row too; every other
    row of the suite is in "not_run" and in each table of mqar.md as "not run"."""
    quiet = dict(log=lambda line: None)
    first = mqar_suite.run_suite(QUICK, tmp_path, rows=("transformer_full",), **quiet)
    assert list(first["rows"]) == ["transformer_full"] and list(first["not_run"]) == list(mqar_suite.ROWS[1:])
    assert first["not_run"]["mela"] == {"runs_done": 0, "runs_needed": len(QUICK.lrs) + len(QUICK.seeds) - 1}
    second = mqar_suite.run_suite(QUICK, tmp_path, rows=("mlp_lm",), **quiet)
    assert list(second["rows"]) == ["transformer_full", "mlp_lm"] and "mlp_lm" not in second["not_run"]
    assert second["rows"]["transformer_full"] == first["rows"]["transformer_full"]
    markdown = (tmp_path / "mqar.md").read_text()
    for name in second["not_run"]:
        assert markdown.count(f"| {name} |") == 3 and f"| {name} | - | not run (runs done 0 of 3) |" in markdown, name
    assert {v["verdict"] for v in second["verdicts"] if v["hypothesis"] == "H6"} == {"not run"}


def test_runs_train_with_subnormals_flushed_and_the_setting_is_restored(tmp_path):
    """Every row trains flushed (the transformer rows' torchtitan build no longer flushes on its own)
    and the caller's setting comes back after the suite."""
    before = flushing_denormals()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormal floats")
    seen = []
    original = mqar.train

    def watched(*args, **kwargs):
        seen.append(flushing_denormals())
        return original(*args, **kwargs)

    try:
        torch.set_flush_denormal(False)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(mqar, "train", watched)
            mqar_suite.run_suite(QUICK, tmp_path, rows=("transformer_full", "titans_lmm"), log=lambda line: None)
        assert len(seen) == 2 * (len(QUICK.lrs) + len(QUICK.seeds) - 1) and all(seen), seen
        assert not flushing_denormals()
    finally:
        torch.set_flush_denormal(before)


def test_both_plots_draw_every_row_past_ten(tmp_path, monkeypatch):
    """tab10 has 10 colours: an 11th row (plateau32's Mela) was left out of both PNGs, no word said."""
    from torchtitan_ext.eval import mqar_report

    names = [f"row{i}" for i in range(12)]
    setting = {"train_kv": [2], "batch_size": 4, "train_len": 16, "eval_kv": [2], "eval_lengths": [16, 32]}
    curve = [[100, {"2": 0.5}], [200, {"2": 0.9}]]
    results = {"setting": setting,
               "rows": {n: {"cost": {"train_flops_per_token": 1e3}, "seeds": {"0": {"curve_by_kv": curve}}} for n in names},
               "summary": {n: {mqar_verdicts.task_key(2, length): {"pooled": 0.5, "ci95": [0.4, 0.6]} for length in (16, 32)}
                           for n in names}}
    drawn = []
    save = mqar_report._save
    monkeypatch.setattr(mqar_report, "_save", lambda plt, fig, axes, path: drawn.append(
        axes[0].get_legend_handles_labels()) or save(plt, fig, axes, path))
    for draw in (mqar_report.plot_flops, mqar_report.plot):  # a line each, or an errorbar container
        draw(results, tmp_path / "plot.png")
        handles, labels = drawn.pop()
        assert labels == names
        assert len({(h.lines[0] if hasattr(h, "lines") else h).get_color() for h in handles}) == len(names)
