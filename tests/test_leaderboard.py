"""scripts/leaderboard.py: the ci suite end to end on one row of each kind (from scratch,
window-only control, backbone, graft, test-time method; the whole ci suite takes about 9
minutes, docs/leaderboard.md), its rerun skipping every cell, the ci suite's rows covering
every family and graft of the comparison, bad input, the paper suite's dry run at 8, 32 and 128 ranks, the cpu
suite's equal non-embedding parameters, and the verdict rule on synthetic intervals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from torchtitan_ext.eval.leaderboard import combine, verdict
from torchtitan_ext.eval.leaderboard_launch import non_embedding_params
from torchtitan_ext.eval.leaderboard_suites import HYPOTHESES, SUITES


TEST_TIME = [row.name for row in SUITES["ci"].rows if row.kind == "test_time"]
# one row of each kind: from scratch (a streaming memory, the window-only control), the backbone,
# a graft, a test-time method
TEST_ROWS = ["transformer_window", "mela", "backbone_frozen", "memoryllama_alma", "locas_glu"]


def leaderboard(*args: str, timeout: int = 3600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "scripts/leaderboard.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory, tokenizer_dir):
    """The ci suite's TEST_ROWS run twice into one folder: (folder, first run, second run)."""
    out = tmp_path_factory.mktemp("leaderboard")
    first = leaderboard("--suite", "ci", "--rows", ",".join(TEST_ROWS), "--out", str(out))
    second = leaderboard("--suite", "ci", "--rows", ",".join(TEST_ROWS), "--out", str(out))
    return out, first, second


@pytest.mark.slow
def test_the_ci_suite_writes_every_row_with_intervals(ci_run):
    out, first, _ = ci_run
    assert first.returncode == 0, first.stderr[-3000:]
    results = json.loads((out / "leaderboard.json").read_text())
    assert set(results["rows"]) == set(TEST_ROWS)
    for name, row in results["rows"].items():
        for summary in row["ppl_by_length"].values():
            assert summary["pooled"] > 1 and len(summary["ci95"]) == 2 and summary["per_seed"], name
        assert row["cost"]["mean"]["eval_tokens_per_s"] > 0, name
        recall = [summary for task in row["recall_by_length"].values() for summary in task.values()]
        assert all(len(s["ci95"]) == 2 and s["per_seed"] for s in recall), name
        assert recall or row["mode"] == "sliding" and name in TEST_TIME, name
    trained = [n for n, r in results["rows"].items() if "train_tokens_per_s" in r["cost"]["mean"]]
    assert len(trained) == sum(r.kind in ("scratch", "graft") for r in SUITES["ci"].rows if r.name in TEST_ROWS)
    assert [h["claim"] for h in results["hypotheses"]] == [h.claim for h in HYPOTHESES]
    markdown = (out / "leaderboard.md").read_text()
    assert all(f"| {name} |" in markdown for name in results["rows"]) and "not run" in markdown
    assert (out / "ppl_vs_length.png").stat().st_size and (out / "recall_vs_length.png").stat().st_size
    assert list((out / "runs" / "mela" / "seed0").glob("**/wandb/offline-run-*")), "no offline wandb run"


@pytest.mark.slow
def test_a_rerun_skips_every_finished_cell(ci_run):
    out, first, second = ci_run
    cells = len(TEST_ROWS) * len(SUITES["ci"].seeds)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"cells run 0, skipped {cells}" in second.stdout


def test_the_ci_suite_has_every_family_and_graft_of_the_comparison():
    assert {row.name for row in SUITES["ci"].rows} == {
        "transformer_full", "transformer_window", "titans_mac", "titans_mag", "titans_mal", "titans_lmm", "mela",
        "mela_memory_off", "mlp_lm", "backbone_frozen", "lora_only", "memoryllama_alma", "memoryllama_gema", "mone",
        "locas_glu", "templora"}
    assert {row.name for row in SUITES["cpu"].rows} == {row.name for row in SUITES["ci"].rows}


@pytest.mark.parametrize("args,message", [
    (["--suite", "gpu"], "unknown suite 'gpu'"),
    (["--suite", "ci", "--rows", "mela,titans_xyz"], "unknown row(s) ['titans_xyz']"),
])
def test_bad_input_is_one_line_and_exit_2_writing_nothing(tmp_path, args, message):
    run = leaderboard(*args, "--out", str(tmp_path / "out"))
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0 and message in run.stderr, run.stderr
    assert not (tmp_path / "out").exists()


def test_a_folder_holding_another_suite_is_refused(tmp_path):
    (tmp_path / "suite.json").write_text(json.dumps({"suite": "cpu"}))
    run = leaderboard("--suite", "ci", "--out", str(tmp_path))
    assert run.returncode == 2 and run.stderr.startswith("error:") and "holds suite 'cpu'" in run.stderr
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


def test_the_cpu_suites_estimate_counts_its_cells():
    run = leaderboard("--suite", "cpu", "--estimate")
    assert run.returncode == 0 and f"= {len(SUITES['cpu'].rows) * 3} cells" in run.stdout, run.stderr[-2000:]


def test_the_cpu_suites_scratch_rows_have_equal_non_embedding_parameters_within_5_percent():
    counts = {row.name: non_embedding_params(row) for row in SUITES["cpu"].rows if row.kind == "scratch"}
    low, high = min(counts.values()), max(counts.values())
    assert high <= 1.05 * low, counts


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
