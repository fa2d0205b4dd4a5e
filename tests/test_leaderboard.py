"""scripts/leaderboard.py: the ci suite end to end on one row of each kind (from scratch,
window-only control, backbone, graft, the graft read as a bounded stream, test-time method) and both GradMem rows (the whole ci
suite takes about 9 minutes, docs/leaderboard.md), its rerun skipping every cell, GradMem's
recall prompts and perplexity segments (write_read), its twins' equal trainable parameters, the ci suite's rows covering
every family and graft of the comparison, bad input, the paper suite's dry run at 8, 32 and 128 ranks, the cpu
suite's equal non-embedding parameters, and the verdict rule on synthetic intervals."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import load_script, REPO
from torchtitan_ext.eval import leaderboard_cells
from torchtitan_ext.eval.leaderboard import combine, verdict
from torchtitan_ext.eval.leaderboard_launch import built_model, non_embedding_params, trainable_params
from torchtitan_ext.eval.leaderboard_suites import BABILONG_TASKS, EXPLORATORY, HYPOTHESES, SUITES
from training_runs import pretrained_backbone


TEST_TIME = [row.name for row in SUITES["ci"].rows if row.kind == "test_time"]
# one row of each kind: from scratch (a streaming memory, the window-only control), the backbone,
# a graft, the graft read as a bounded stream (its runs shared), a test-time method; and GradMem's
# two WRITEs (write_read), the GradMem hypothesis's rows
TEST_ROWS = ["transformer_window", "mela", "backbone_frozen", "memoryllama_alma", "memoryllama_alma_bounded",
             "locas_glu", "gradmem", "gradmem_forward"]
GRADMEM_CLAIM = "The GradMem gradient WRITE beats the forward WRITE"


def leaderboard(*args: str, timeout: int = 3600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "scripts/leaderboard.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory, tokenizer_dir, seed_cache):
    """The ci suite's TEST_ROWS run twice into one folder, mela's cell stripped of its zero-shot
    scores between the runs (a cell finished before that column): (folder, first run, second
    run, mela's zero-shot scores of the first run). The folder starts with the session's
    pretrained backbone (tests/training_runs.py `pretrained_backbone`, the script run as the
    suite runs it: `test_the_backbone_is_pretrained_once_as_the_suite_asks`)."""
    out = tmp_path_factory.mktemp("leaderboard")
    shutil.copytree(pretrained_backbone(seed_cache)[0], out / "backbone")
    first = leaderboard("--suite", "ci", "--rows", ",".join(TEST_ROWS), "--out", str(out))
    mela = out / "cells" / "mela" / "seed0.json"
    cell = json.loads(mela.read_text()) if mela.is_file() else {}
    mela.write_text(json.dumps({k: v for k, v in cell.items() if k != "zero_shot"}))
    second = leaderboard("--suite", "ci", "--rows", ",".join(TEST_ROWS), "--out", str(out))
    return out, first, second, cell.get("zero_shot")


@pytest.mark.slow
def test_the_ci_suite_writes_every_row_with_intervals(ci_run):
    out, first, _, _ = ci_run
    assert first.returncode == 0, first.stderr[-3000:]
    results = json.loads((out / "leaderboard.json").read_text())
    assert set(results["rows"]) == set(TEST_ROWS)
    for name, row in results["rows"].items():
        for summary in row["ppl_by_length"].values():
            assert summary["pooled"] > 1 and len(summary["ci95"]) == 2 and summary["per_seed"], name
        assert row["cost"]["mean"]["eval_tokens_per_s"] > 0, name
        recall = [summary for task in row["recall_by_length"].values() for summary in task.values()]
        assert all(len(s["ci95"]) == 2 and s["per_seed"] for s in recall), name
        assert recall, name
    for name, row in results["rows"].items():  # lm-eval on every export; a test-time method has none,
        if name in TEST_TIME or row["mode"] in ("write_read", "bounded_stream"):  # nor GradMem, which reads after a
            # write only, nor a bounded stream (lm-eval does not stream; its model's export is its source row's)
            assert row["zero_shot"] is None, name
            continue
        (cloze,) = row["zero_shot"].values()
        assert 0 <= cloze["pooled"] <= 1 and cloze["per_seed"][0]["items"] == SUITES["ci"].zero_shot_items, name
    trained = [n for n, r in results["rows"].items() if "train_tokens_per_s" in r["cost"]["mean"]]
    assert len(trained) == sum(r.kind in ("scratch", "graft") for r in SUITES["ci"].rows if r.name in TEST_ROWS)
    assert [h["claim"] for h in results["hypotheses"]] == [h.claim for h in HYPOTHESES]
    assert [h["claim"] for h in results["exploratory"]] == [h.claim for h in EXPLORATORY]
    # the bounded stream reads memoryllama_alma's checkpoints (no run of its own) with caches cut to the window
    bounded, unbounded = results["rows"]["memoryllama_alma_bounded"], results["rows"]["memoryllama_alma"]
    assert not (out / "runs" / "memoryllama_alma_bounded").exists() and bounded["mode"] == "bounded_stream"
    assert bounded["cost"]["mean"]["train_tokens_per_s"] == unbounded["cost"]["mean"]["train_tokens_per_s"]
    assert bounded["cost"]["mean"]["state_bytes"] < unbounded["cost"]["mean"]["state_bytes"]
    assert results["rows"]["gradmem"]["mode"] == results["rows"]["gradmem_forward"]["mode"] == "write_read"
    for name in ("gradmem", "gradmem_forward"):  # every length of perplexity and of recall
        assert len(results["rows"][name]["ppl_by_length"]) == 4 and results["rows"][name]["recall_beyond_window"], name
        assert results["rows"][name]["cost"]["mean"]["state_bytes"] == 8 * 128 * 4, name  # m x dim float32
    (gradmem,) = [h for h in results["hypotheses"] if h["claim"] == GRADMEM_CLAIM]
    assert gradmem["verdict"] != "not run" and all(c["verdict"] != "not run" for c in gradmem["comparisons"])
    markdown = (out / "leaderboard.md").read_text()
    assert all(f"| {name} |" in markdown for name in results["rows"]) and "not run" in markdown
    assert (out / "ppl_vs_length.png").stat().st_size and (out / "recall_vs_length.png").stat().st_size
    assert list((out / "runs" / "mela" / "seed0").glob("**/wandb/offline-run-*")), "no offline wandb run"


def test_the_backbone_is_pretrained_once_as_the_suite_asks(monkeypatch, tmp_path):
    """`backbone_folder` runs `pretrain_command`: scripts/pretrain_backbone.sh into out/backbone
    with the suite's STEPS and NIAH_SAMPLES in the launcher's environment, and not again once
    out/hf holds a config (how the ci fixture's copy of the session's backbone is taken)."""
    calls = []

    def pretrain(command, cwd, env, check, stdout):
        calls.append((command, env))
        (tmp_path / "backbone" / "hf").mkdir(parents=True)
        (tmp_path / "backbone" / "hf" / "config.json").write_text("{}")

    monkeypatch.setattr(leaderboard_cells.subprocess, "run", pretrain)
    ci = SUITES["ci"]
    for _ in range(2):
        assert leaderboard_cells.backbone_folder(tmp_path / "backbone", ci) == tmp_path / "backbone" / "hf"
    ((command, env),) = calls
    assert command == ["bash", "scripts/pretrain_backbone.sh", str(tmp_path / "backbone")]
    assert env == {**leaderboard_cells.train_env(), "STEPS": str(ci.backbone_steps), "NIAH_SAMPLES": str(ci.recall_samples)}


@pytest.mark.slow
def test_a_rerun_skips_every_finished_cell_and_adds_a_missing_zero_shot_column(ci_run):
    out, first, second, mela_zero_shot = ci_run
    cells = len(TEST_ROWS) * len(SUITES["ci"].seeds)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"cells run 0, skipped {cells}" in second.stdout
    assert mela_zero_shot and json.loads((out / "cells" / "mela" / "seed0.json").read_text())["zero_shot"] == mela_zero_shot


def test_the_ci_suite_has_every_family_and_graft_of_the_comparison():
    assert {row.name for row in SUITES["ci"].rows} == {
        "transformer_full", "transformer_window", "titans_mac", "titans_mac_inputs", "titans_mag", "titans_mal",
        "titans_lmm", "mela",
        "mela_memory_off", "mlp_lm", "backbone_frozen", "lora_only", "memoryllama_alma", "memoryllama_gema", "mone",
        "gradmem", "gradmem_forward", "locas_glu", "templora", "backbone_frozen_bounded", "lora_only_bounded",
        "memoryllama_alma_bounded", "memoryllama_gema_bounded"}
    assert {row.name for row in SUITES["cpu"].rows} == {row.name for row in SUITES["ci"].rows}


def test_mac_writing_inputs_differs_from_the_papers_mac_only_in_what_its_memory_writes():
    """The perplexity-beside-recall row (issue 48): the same model and parameter count as the
    paper's MAC in both suites, its memory writing the segment's inputs."""
    for name in ("ci", "cpu"):
        rows = {row.name: row for row in SUITES[name].rows}
        ours, paper = built_model(rows["titans_mac_inputs"]), built_model(rows["titans_mac"])
        assert (ours.cfg.mac_write, paper.cfg.mac_write) == ("inputs", "attention"), name
        assert ours.cfg == dataclasses.replace(paper.cfg, mac_write="inputs"), name
        assert trainable_params(rows["titans_mac_inputs"]) == trainable_params(rows["titans_mac"]), name


def test_the_gradmem_twins_differ_in_the_write_and_train_as_many_parameters_within_1_percent():
    rows = {row.name: row for row in SUITES["ci"].rows}
    built = {name: built_model(rows[name]) for name in ("gradmem", "gradmem_forward")}
    writes = {name: model.gradmem.cfg.write for name, model in built.items()}
    assert writes == {"gradmem": "gradient", "gradmem_forward": "forward"}
    assert {m.gradmem.cfg.write_steps for m in built.values()} == {2} and {m.cfg.dim for m in built.values()} == {128}
    trained = {name: trainable_params(rows[name]) for name in built}
    assert abs(trained["gradmem"] - trained["gradmem_forward"]) <= 0.01 * trained["gradmem"], trained


class _FakeEntry:
    mode, window = "write_read", 64


@pytest.mark.parametrize("task", ["kv_retrieval", "s_niah", "qa1"])
def test_a_gradmem_rows_recall_question_starts_at_restarted_positions_after_its_context(monkeypatch, tokenizer_dir,
                                                                                          task):
    """The prompt a write_read row answers is BOS + context, then the question, which `answer`
    is told starts a new segment at the context's length (positions restart there); a streaming
    row's is the drawn prompt with the question continuing it (query 0)."""
    from torchtitan_ext.data.synthetic_tasks import fit_sample
    from torchtitan_ext.eval import babilong, tasks

    tokenizer, chosen = leaderboard_cells.tokenizer_of(str(tokenizer_dir)), SUITES["ci"]
    calls = []
    monkeypatch.setattr(tasks, "answer", lambda entry, ids, new, query=0: calls.append((entry.mode, ids, query)) or [])
    leaderboard_cells.task_scores(_FakeEntry(), tokenizer, chosen, task, 256)
    streaming = type("Streaming", (), {"mode": "streaming", "window": 64})()
    leaderboard_cells.task_scores(streaming, tokenizer, chosen, task, 256)
    if task in BABILONG_TASKS:
        ((drawn, sample),) = babilong.items([task], ["256"], 1, 0, tokenizer)[task, "256"]
    else:
        drawn, sample = fit_sample(task, random.Random(f"{task}-256"), tokenizer, 256)
    context = tokenizer.encode(sample.context, add_bos=True, add_eos=False)
    question = tokenizer.encode(sample.query, add_bos=False, add_eos=False)
    assert calls == [("write_read", context + question, len(context)), ("streaming", drawn, 0)]


def test_a_test_time_row_answers_by_the_model_that_learned_from_the_whole_prompt(monkeypatch, tokenizer_dir):
    """`learned` gets the whole prompt (context and question); the answer comes from the entry
    it returns, reading the prompt's last window tokens (the backbone's sliding window)."""
    from torchtitan_ext.data.synthetic_tasks import fit_sample
    from torchtitan_ext.eval import tasks

    tokenizer, chosen = leaderboard_cells.tokenizer_of(str(tokenizer_dir)), SUITES["ci"]
    sliding = type("Sliding", (), {"mode": "sliding", "window": 64})()
    adapted = type("Adapted", (), {"mode": "sliding", "window": 64})()
    read, calls = [], []
    monkeypatch.setattr(tasks, "answer", lambda entry, ids, new, query=0: calls.append((entry, ids)) or [])
    leaderboard_cells.task_scores(sliding, tokenizer, chosen, "s_niah", 256, lambda ids: read.append(ids) or adapted)
    drawn, _ = fit_sample("s_niah", random.Random("s_niah-256"), tokenizer, 256)
    assert read == [drawn] and calls == [(adapted, drawn[-64:])]


def test_gradmem_perplexity_reads_each_segment_after_the_memory_of_every_token_before_it():
    """write_read perplexity: segment 0 after M_0, segment k after the memory written from the
    tokens before it (not the previous segment alone), each read from position 0."""
    from models.grafts.gradmem import GradMemLM
    from torchtitan_ext.eval.long_ppl import Entry
    from torchtitan_ext.families.gradmem import model_config

    torch.manual_seed(0)
    model = GradMemLM(model_config("kv_debug")).eval()
    entry, w = Entry("gradmem", model, "write_read", 8, 0, 1024), 8
    tokens = torch.randint(0, 70, (1, 3 * w))
    logits = leaderboard_cells.write_read_logits(entry, tokens)
    with torch.no_grad():
        first = model.read(model.gradmem.initial(1), tokens[:, :w])
        second = model.read(model.write(tokens[:, :w], torch.tensor([w]))[0], tokens[:, w:2 * w])
    assert logits.shape == (1, 3 * w, 70)
    torch.testing.assert_close(logits[:, :w], first)
    torch.testing.assert_close(logits[:, w:2 * w], second)
    changed = tokens.clone()
    changed[0, 1] = (changed[0, 1] + 1) % 70  # inside segment 0: reaches segment 2 through its memory
    other = leaderboard_cells.write_read_logits(entry, changed)
    assert (other[:, 2 * w:] - logits[:, 2 * w:]).abs().max() > 1e-6
    changed = tokens.clone()
    changed[0, 2 * w] = (changed[0, 2 * w] + 1) % 70  # inside segment 2: no earlier logit moves
    torch.testing.assert_close(leaderboard_cells.write_read_logits(entry, changed)[:, :2 * w], logits[:, :2 * w])
    nll = leaderboard_cells.document_nll(entry, tokens)
    assert nll.shape == (1, 3 * w - 1) and torch.isfinite(nll).all()


@pytest.mark.parametrize("args,message", [
    (["--suite", "gpu"], "unknown suite 'gpu'"),
    (["--suite", "ci", "--rows", "mela,titans_xyz"], "unknown row(s) ['titans_xyz']"),
    (["--suite", "paper"], "pass --dry-run to preflight them"),  # not the debug rows in one process
])
def test_bad_input_is_one_line_and_exit_2_writing_nothing(tmp_path, args, message, capsys):
    """In process (the script's `main`, which exits 2); the script runs as a process in the ci fixture and the dry run."""
    with pytest.raises(SystemExit) as exit_:
        load_script("leaderboard").main([*args, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.strip().count("\n") == 0 and message in err, err
    assert not (tmp_path / "out").exists()


def test_a_folder_holding_another_suite_is_refused(tmp_path, capsys):
    (tmp_path / "suite.json").write_text(json.dumps({"suite": "cpu"}))
    with pytest.raises(SystemExit) as exit_:
        load_script("leaderboard").main(["--suite", "ci", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error:") and "holds suite 'cpu'" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["suite.json"]


def test_the_paper_suite_passes_preflight_at_8_32_and_128_ranks(tokenizer_dir):
    """The Llama-2 tokenizer cannot ship: the offline one stands in for it (as in
    tests/test_preflight.py's README check)."""
    run = leaderboard("--suite", "paper", "--dry-run", "--hf-assets-path", str(tokenizer_dir))
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("[")]
    assert len(lines) == 3 * len(SUITES["paper"].rows) and all(line.startswith("[ok]") for line in lines)
    for nodes in (1, 4, 16):
        assert f"NNODES={nodes} NPROC_PER_NODE=8 MASTER_ADDR=" in run.stdout


def test_the_cpu_suites_estimate_counts_its_cells(capsys):
    load_script("leaderboard").main(["--suite", "cpu", "--estimate"])
    assert f"= {len(SUITES['cpu'].rows) * 3} cells" in capsys.readouterr().out


def test_the_cpu_suites_scratch_rows_have_equal_non_embedding_parameters_within_5_percent():
    counts = {row.name: non_embedding_params(row) for row in SUITES["cpu"].rows if row.kind == "scratch"}
    low, high = min(counts.values()), max(counts.values())
    assert high <= 1.05 * low, counts


def test_a_relative_out_folder_reaches_the_cells_absolute(monkeypatch, tmp_path):
    """The grafts' initial load from out/backbone/hf must be absolute for torchtitan."""
    script = load_script("leaderboard")
    seen = []
    monkeypatch.setattr(script.leaderboard_cells, "run_cells",
                        lambda rows, chosen, out: seen.append(out) or {"run": 0, "skipped": 0})
    monkeypatch.setattr(script.leaderboard, "report", lambda out, chosen: None)
    monkeypatch.chdir(tmp_path)
    script.main(["--suite", "ci", "--rows", "lora_only", "--out", "relative"])
    assert seen == [tmp_path / "relative"] and (tmp_path / "relative" / "suite.json").is_file()


def test_without_lm_eval_the_zero_shot_column_is_skipped_with_one_line_naming_the_fix(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    assert not leaderboard_cells.zero_shot_available(SUITES["ci"])
    assert capsys.readouterr().err.strip() == ("warning: zero-shot column skipped: lm_eval is not installed "
                                               "(EXTRAS=eval bash scripts/setup.sh); a later run fills it in")
    monkeypatch.undo()
    assert leaderboard_cells.zero_shot_available(SUITES["ci"]) and not leaderboard_cells.zero_shot_available(SUITES["paper"])


def test_every_trained_row_of_the_cpu_suite_has_a_hugging_face_form_for_its_zero_shot_export():
    """`hf_form` (the export's config and adapter) resolves each row's own sizes; a row whose
    flavor the family does not know (the cpu Transformer++ once) fails here, not after training."""
    from torchtitan_ext.hf_export import export_family, hf_form
    from torchtitan_ext.training import cli

    for row in SUITES["cpu"].rows:
        if row.kind in ("scratch", "graft"):
            spec = cli.parse(["--module", *row.config.split(":", 1)[:1], "--config", row.config.split(":", 1)[1]]).model_spec
            model = built_model(row)
            config, adapter = hf_form(export_family(spec.name), spec, model)
            assert adapter is not None, row.name
            if config is not None:  # a plain transformers class: the row's own depth and width
                layers = getattr(model, "layers", None)
                assert config.num_hidden_layers == len(layers), row.name
                assert config.hidden_size == model.tok_embeddings.weight.shape[1], row.name


def test_the_cpu_suites_grafts_continue_on_the_backbones_mix_at_one_lora_rate():
    """Every trained graft of the cpu suite (not GradMem's own task rows) trains on the
    backbone's pretraining mix with other draws, its LoRA at one rate for every row."""
    import importlib

    from train_configs.backbone import backbone_qwen3_pretrain, LORA_PARAMETERS

    backbone = backbone_qwen3_pretrain().dataloader
    for row in SUITES["cpu"].rows:
        if row.kind != "graft" or row.runs_of or row.mode == "write_read":
            continue
        module, function = row.config.split(":")
        config = getattr(importlib.import_module(module), function)()
        mix = config.dataloader
        assert (mix.tasks, mix.lengths, mix.task_fraction, mix.task_labels) == \
            (backbone.tasks, backbone.lengths, backbone.task_fraction, backbone.task_labels), row.name
        assert mix.seed != backbone.seed, row.name
        lora = [g.optimizer_kwargs["lr"] for g in config.optimizer.param_groups if g.pattern == LORA_PARAMETERS]
        assert lora == [5e-4], row.name


def test_the_cpu_suites_grafts_train_as_many_parameters_within_5_percent():
    """Every trained graft of the cpu suite (its LoRA, memory, heads), the LoRA-only control too;
    the ci suite's debug configs do not (rank 8 everywhere), so the check can fail."""
    def counts(suite: str) -> dict[str, int]:
        return {row.name: trainable_params(row) for row in SUITES[suite].rows if row.kind == "graft" and not row.runs_of}

    cpu, ci = counts("cpu"), counts("ci")
    assert set(cpu) == {"lora_only", "memoryllama_alma", "memoryllama_gema", "mone", "gradmem", "gradmem_forward"}
    assert max(cpu.values()) <= 1.05 * min(cpu.values()), cpu
    assert max(ci.values()) > 1.05 * min(ci.values()), ci


@pytest.mark.parametrize("interval,metric,sense,expected", [
    ((0.1, 0.3), "recall_beyond", "better", "supported"),
    ((-0.3, -0.1), "recall_beyond", "better", "not supported"),
    ((-0.1, 0.3), "recall_beyond", "better", "inconclusive"),
    ((0.8, 0.95), "ppl_past", "better", "supported"),
    ((1.01, 1.2), "ppl_past", "better", "not supported"),
    ((0.97, 1.04), "ppl_past", "match", "supported"),
    ((1.06, 1.2), "ppl_past", "match", "not supported"),
    ((0.9, 1.02), "ppl_past", "match", "inconclusive"),
    ((1.5, 2.0), "eval_cost", "better", "supported"),
    (None, "recall_inside", "match", "not run"),
])
def test_the_verdict_rule_on_synthetic_intervals(interval, metric, sense, expected):
    assert verdict(interval, metric, sense) == expected


def test_a_hypothesis_is_supported_only_when_every_comparison_is():
    assert combine(["supported", "supported"]) == "supported"
    assert combine(["supported", "inconclusive"]) == "inconclusive at this scale"
    assert combine(["inconclusive", "not supported"]) == "not supported"
    assert combine(["supported", "not run"]) == "not run"


@pytest.fixture(scope="module")
def mqar_quick(tmp_path_factory):
    """`--suite mqar --quick` once: (folder, its run)."""
    out = tmp_path_factory.mktemp("mqar")
    return out, leaderboard("--suite", "mqar", "--quick", "--out", str(out), timeout=600)


def test_verdicts_from_json(mqar_quick):
    """Every verdict (and its interval) rebuilt from mqar.json alone equals the one written;
    the rebuild reads the items: the full row made perfect turns H1 supported. Each run holds
    its plateau fields (stop, accuracy at the stop, steps and FLOPs to 0.5 / 0.8 / 0.99, checked
    against its curve and cost here); the window-only control, answering none of its in-window
    queries right, leaves H2-H5 without a verdict until it is made perfect inside its window; the
    sample-efficiency hypotheses read the runs' FLOPs to 0.8."""
    from torchtitan_ext.eval import mqar_suite, mqar_verdicts

    out, run = mqar_quick
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((out / "mqar.json").read_text())
    assert results["verdicts"] and mqar_verdicts.verdicts(results) == results["verdicts"]
    assert {v["hypothesis"] for v in results["verdicts"]} == {h.key for h in mqar_suite.HYPOTHESES}
    perfect = json.loads((out / "mqar.json").read_text())
    for seed in perfect["rows"]["transformer_full"]["seeds"].values():
        for task in seed["tasks"].values():
            task["correct"] = [[1] * len(q) for q in task["correct"]]
    rebuilt = [v for v in mqar_verdicts.verdicts(perfect) if v["hypothesis"] == "H1"]
    assert rebuilt and all(v["verdict"] == "supported" and v["ci95"] == [1.0, 1.0] for v in rebuilt)
    s = mqar_suite.SETTINGS["quick"]
    for name, row in results["rows"].items():
        for run in row["seeds"].values():
            assert run["stop"] in ("target", "plateau", "cap", "non-finite"), name
            assert run["curve"][-1][0] == run["stop_step"] <= 2 * 2, name  # cap: 2 x 2 steps
            assert run["plateau_accuracy"] == run["curve"][-1][1] == run["val_accuracy"], name
            accuracies = [a for _, a in run["curve"]]  # one a step (eval_every 1), window 2
            if run["stop"] == "plateau":
                assert len(accuracies) > 2 and max(accuracies[-2:]) <= max(accuracies[:-2]) + 0.01, name
            if run["stop"] == "cap":
                assert run["stop_step"] == 4, name
            for level in ("0.5", "0.8", "0.99"):
                first = [step for step, accuracy in run["curve"] if accuracy >= float(level)]
                expected = None if not first else {"step": first[0], "train_flops": first[0] * 4 * 16 * row["cost"][
                    "train_flops_per_token"]}  # batch 4 x length 16
                assert run["reach"][level] == expected, (name, level)
    windowed = [v for v in results["verdicts"] if v["hypothesis"].rstrip("r") in ("H2", "H3", "H4", "H5")]
    assert {v["hypothesis"] for v in windowed} == {"H2", "H3", "H4", "H5", "H2r", "H3r", "H4r", "H5r"}
    for v in windowed:
        control = "transformer_window_reach" if v["hypothesis"].endswith("r") else "transformer_window"
        right = asked = 0  # the control's queries within its window on this task, every seed
        for seed in results["rows"][control]["seeds"].values():
            task = seed["tasks"][v["task"]]
            for c, far in zip(task["correct"], task["distance"]):
                right += sum(ok for ok, d in zip(c, far) if d <= s.window)
                asked += sum(d <= s.window for d in far)
        assert v["control_inside"] == pytest.approx(right / asked), v
        if not v["verdict"].startswith("at floor") and right / asked < 0.9:
            assert v["verdict"] == f"no control (window-only control answers {right / asked:.2f} inside its window < 0.9)", v
        elif not v["verdict"].startswith("at floor"):
            assert v["verdict"] in ("supported", "not supported", "inconclusive"), v
    assert any(v["verdict"].startswith("no control") for v in windowed)  # the rule, not only the floor, acts here
    solved = json.loads((out / "mqar.json").read_text())
    for seed in solved["rows"]["transformer_window"]["seeds"].values():
        for task in seed["tasks"].values():
            task["correct"] = [[int(ok or d <= s.window) for ok, d in zip(c, far)]
                               for c, far in zip(task["correct"], task["distance"])]
    for v in mqar_verdicts.verdicts(solved):
        if v["hypothesis"] in ("H2", "H3", "H4", "H5") and not v["verdict"].startswith("at floor"):
            assert v["control_inside"] == 1.0 and v["verdict"] in ("supported", "not supported", "inconclusive"), v
    # sample efficiency (S1-S3) is read from the runs' reach fields: MAC writing inputs made to reach 0.8 at half
    # the paper MAC's training FLOPs on every seed gives S1 a gain of exactly 1 (log2), supported
    faster = json.loads((out / "mqar.json").read_text())
    for seed, run in faster["rows"]["titans_mac"]["seeds"].items():
        run["reach"]["0.8"] = {"step": 4, "train_flops": 2e9}
        faster["rows"]["titans_mac_inputs"]["seeds"][seed]["reach"]["0.8"] = {"step": 2, "train_flops": 1e9}
    (s1,) = [v for v in mqar_verdicts.verdicts(faster) if v["hypothesis"] == "S1"]
    assert s1["verdict"] == "supported" and s1["estimate"] == 1.0 and s1["paired_seeds"] == len(faster["rows"]["titans_mac"]["seeds"])


def test_the_mqar_suite_writes_every_item_per_row_seed_and_task(mqar_quick, capsys):
    from torchtitan_ext.eval import mqar_suite, mqar_verdicts

    out, run = mqar_quick
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((out / "mqar.json").read_text())
    s = mqar_suite.SETTINGS["quick"]
    assert list(results["rows"]) == list(mqar_suite.ROWS)
    for name, row in results["rows"].items():
        assert [r["lr"] for r in row["sweep"]] == list(s.lrs) and row["best_lr"] in s.lrs, name
        assert sorted(row["seeds"], key=int) == [str(k) for k in s.seeds], name
        for seed in row["seeds"].values():
            assert seed["lr"] == row["best_lr"], name
            assert set(seed["tasks"]) == {mqar_suite.task_key(kv, n) for kv, n in s.tasks()}, name
            for task in seed["tasks"].values():
                assert len(task["correct"]) == s.test_prompts and all(len(q) == task["kv"] for q in task["correct"])
                assert all(set(q) <= {0, 1} for q in task["correct"]), name
        for key, summary in results["summary"][name].items():
            assert summary["ci95"][0] <= summary["pooled"] <= summary["ci95"][1] and len(summary["per_seed"]) == 2
        cost = row["cost"]
        assert cost["trainable_params"] > 0 and cost["train_flops_per_token"] > cost["eval_flops_per_token"] > 0, name
        assert cost["state_bytes"] > 0 and cost["train_tokens_per_s"] > 0, name
        stops = [r["stop_step"] for r in row["seeds"].values()]
        assert cost["training_tokens"] == sum(stops) / len(stops) * s.batch_size * s.train_len, name
    # prompts differ across seeds (drawn per seed), and are the same for every row within a seed
    first = results["rows"]["transformer_full"]["seeds"]
    assert first["0"]["tasks"]["kv2_len16"]["distance"] != first["1"]["tasks"]["kv2_len16"]["distance"]
    assert all(r["seeds"]["1"]["tasks"]["kv2_len16"]["distance"] == first["1"]["tasks"]["kv2_len16"]["distance"]
               for r in results["rows"].values())
    # the window-only row carries its window's cache, the full row its whole prompt's
    costs = {n: r["cost"]["state_bytes"] for n, r in results["rows"].items()}
    assert costs["transformer_window"] * s.train_len == costs["transformer_full"] * s.window
    markdown = (out / "mqar.md").read_text()
    assert all(f"| {name} |" in markdown for name in mqar_suite.ROWS) and f"LR grid {list(s.lrs)}" in markdown
    split = mqar_verdicts.by_distance(results)  # every query at the training length falls on one side of the window
    assert all(sum(c[1] for c in split[n].values()) == len(s.seeds) * s.test_prompts * sum(
        kv for kv, n_ in s.tasks() if n_ == s.train_len) for n in mqar_suite.ROWS)
    assert (out / "mqar_accuracy.png").stat().st_size > 0 and (out / "mqar_flops.png").stat().st_size > 0
    # a rerun (in this process) reuses every finished row
    load_script("leaderboard").main(["--suite", "mqar", "--quick", "--out", str(out)])
    assert capsys.readouterr().out.count(": reused ") == len(mqar_suite.ROWS)
    assert json.loads((out / "mqar.json").read_text())["verdicts"] == results["verdicts"]
    # a third seed trains only its own runs: the first two seeds' runs are read back
    load_script("leaderboard").main(["--suite", "mqar", "--quick", "--rows", "titans_lmm", "--seeds", "3", "--out", str(out)])
    trained = [line for line in capsys.readouterr().out.splitlines() if line.startswith("titans_lmm seed")]
    assert trained and all(line.startswith("titans_lmm seed 2 ") for line in trained), trained
    assert json.loads((out / "mqar.json").read_text())["rows"]["titans_lmm"]["seeds"]["0"] == results["rows"]["titans_lmm"]["seeds"]["0"]


@pytest.mark.parametrize("args,message", [
    (["--suite", "mqar"], "--out DIR is needed"),
    (["--suite", "mqar", "--rows", "transformer_full,rwkv"], "unknown row(s) ['rwkv'] in suite mqar"),
    (["--suite", "mqar", "--steps", "0"], "--steps must be at least 1"),
])
def test_mqar_bad_input_is_one_line_and_exit_2(tmp_path, args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_script("leaderboard").main([*args, *([] if "--out DIR" in message else ["--out", str(tmp_path / "out")])])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.strip().count("\n") == 0 and message in err, err
    assert not (tmp_path / "out").exists()
