"""scripts/pretrain_backbone.sh end to end at the ci leaderboard suite's settings (10 steps, 1
S-NIAH sample; run once for this file and the leaderboard's ci fixture): its Hugging Face folder
loads in transformers with our checkpoint's logits, niah.json holds the S-NIAH figure; bad input
is one line, exit 2; the mixed text-and-task rows it trains on (torchtitan_ext/data/mixed_data.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import pytest
import torch
from torchtitan.components.loss import IGNORE_INDEX
from transformers import AutoModelForCausalLM

from conftest import REPO
from torchtitan_ext.data.mixed_data import MixedDataLoader
from torchtitan_ext.data.tokenizer import AssetsTokenizer
from torchtitan_ext.eval.leaderboard_suites import SUITES
from torchtitan_ext.training.checkpoints import model_from_checkpoint
from training_runs import pretrained_backbone


def pretrain(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SKIP_SETUP": "1", "SKIP_PREFLIGHT": "1"}
    return subprocess.run(["bash", str(REPO / "scripts" / "pretrain_backbone.sh"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_export_loads_in_transformers_with_our_logits_and_niah_json_is_written(tokenizer_dir, seed_cache):
    out, stdout = pretrained_backbone(seed_cache)
    ci = SUITES["ci"]
    assert stdout.strip().startswith("pretrain_backbone: S-NIAH ") and len(stdout.strip().splitlines()) == 1
    niah = json.loads((out / "niah.json").read_text())
    assert niah["window"] == 256 and niah["samples"] == ci.recall_samples and 0.0 <= niah["exact_match"] <= 1.0
    assert niah["interval"][0] <= niah["exact_match"] <= niah["interval"][1] and niah["steps"] == ci.backbone_steps
    ours, _ = model_from_checkpoint("train_configs.backbone", "backbone_qwen3_pretrain",
                                    out / "backbone" / "checkpoint" / f"step-{ci.backbone_steps}")
    theirs = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    tokens = torch.randint(0, 4096, (2, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours.eval()(tokens), rtol=0, atol=1e-4)


@pytest.mark.parametrize("case", ["no_argument", "foreign_folder"])
def test_bad_input_is_one_line_and_exit_2(case, tmp_path):
    (tmp_path / "notes.txt").write_text("someone else's")
    proc = pretrain() if case == "no_argument" else pretrain(str(tmp_path))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and (tmp_path / "notes.txt").exists()


def test_mixed_rows_are_text_or_answer_labelled_task_rows_at_the_asked_share(tokenizer_dir):
    """Text rows are labelled on every token, task rows on a few answer tokens only; at
    task_fraction 0.75 about 3 in 4 rows are task rows, and the same seed gives the same rows."""
    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(tokenizer_dir))
    config = MixedDataLoader.Config(dataset="embedded", tasks="s_niah,kv_retrieval", lengths="128,256",
                                    task_fraction=0.75)

    def rows(count: int, config=config) -> list[torch.Tensor]:
        loader = MixedDataLoader(config, dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=256,
                                 local_batch_size=1)
        out = []
        for (_, labels) in loader:
            out.append(labels[0])
            if len(out) == count:
                return out

    first, again = rows(40), rows(40)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    labelled = [int((labels != IGNORE_INDEX).sum()) for labels in first]
    assert set(labelled) <= set(range(1, 25)) | {256}
    assert 20 <= sum(n < 256 for n in labelled) <= 38
    # task_labels="row" (the backbone's pretraining): the same rows, each task row labelled on
    # its whole sample, which holds the answer labels
    whole = rows(40, dataclasses.replace(config, task_labels="row"))
    for answer_only, row in zip(first, whole):
        on_answer = answer_only != IGNORE_INDEX
        assert torch.equal(row[on_answer], answer_only[on_answer])
        if on_answer.sum() < 256:
            assert (row != IGNORE_INDEX).sum() > 100
