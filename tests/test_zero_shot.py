"""The leaderboard's local zero-shot task (torchtitan_ext/eval/zero_shot.py): each question's
labelled ending is its passage's own continuation in the held-out prose, the other three are
not, the answer's place varies, and the task folder lm_eval reads is written whole."""

from __future__ import annotations

import json

import yaml

from torchtitan_ext.data.synthetic_tasks import heldout_sentences
from torchtitan_ext.eval.zero_shot import CLOZE_TASK, cloze_items, write_cloze_task


def test_the_labelled_ending_continues_the_passage_and_the_others_do_not():
    text = " ".join(heldout_sentences())
    items = cloze_items(24, seed=0)
    assert items == cloze_items(24, seed=0) and items != cloze_items(24, seed=1)
    for item in items:
        assert len(item["endings"]) == 4 and len(set(item["endings"])) == 4 and len(item["context"]) > 150
        continues = [item["context"] + ending in text for ending in item["endings"]]
        assert continues[item["label"]] and sum(continues) == 1, item
    assert len({item["label"] for item in items}) == 4


def test_the_task_folder_holds_the_yaml_and_its_questions(tmp_path):
    folder = write_cloze_task(tmp_path / "tasks", items=8, seed=3)
    task = yaml.safe_load((folder / f"{CLOZE_TASK}.yaml").read_text())
    assert task["task"] == CLOZE_TASK and task["output_type"] == "multiple_choice"
    data = task["dataset_kwargs"]["data_files"]["test"]
    rows = [json.loads(line) for line in open(data).read().splitlines()]
    assert rows == cloze_items(8, seed=3)
