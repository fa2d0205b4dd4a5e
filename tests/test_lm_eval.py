"""The Hugging Face exports under lm-evaluation-harness (`lm_eval --model hf`, the `eval`
extra): a tiny local task (written here, no download) on a tiny Mela export, and lm_eval's
log-likelihoods equal the project's own for the same tokens; Locas' forgetting check
(scripts/locas_forgetting.py, Table 4) on a merged export and its baseline."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from test_hf import native, run_script
from torchtitan_ext.training.checkpoints import causal_logits
from torchtitan_ext.data.tokenizer import AssetsTokenizer

PAIRS = [("The key 3 maps to value", " 21"), ("def square(x):\n    return", " x**2"), ("Memory is written at", " test time")]
TASK = """task: tiny_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def own_loglikelihood(model, tokenizer, context: str, target: str) -> float:
    """log p(target | context) with lm_eval's token split: context + target encoded whole,
    BOS first (the export's tokenizer_config adds it, as training documents start with it)."""
    whole = tokenizer.encode(context + target, add_bos=True, add_eos=False)
    start = len(tokenizer.encode(context, add_bos=True, add_eos=False))
    logits = causal_logits(model, torch.tensor([whole[:-1]]))[0].double().log_softmax(-1)
    return sum(logits[i - 1, whole[i]].item() for i in range(start, len(whole)))


@pytest.mark.slow
def test_lm_eval_scores_an_export_as_the_project_does(tokenizer_dir, tmp_path):
    assert importlib.util.find_spec("lm_eval"), "lm_eval is missing: EXTRAS=eval bash scripts/setup.sh (test.sh does)"
    config = "train_configs.mela:mela_debug"
    model = native(config, tmp_path / "dcp")
    module, function = config.split(":")
    assert run_script("convert_to_hf.py", "--module", module, "--config", function, "--checkpoint", tmp_path / "dcp",
                      "--out", tmp_path / "hf") == 0
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"context": c, "target": t}) + "\n" for c, t in PAIRS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny.yaml").write_text(TASK.format(data=tmp_path / "data.jsonl"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                          f"pretrained={tmp_path / 'hf'},trust_remote_code=True,dtype=float32", "--tasks", "tiny_local",
                          "--include_path", str(tmp_path / "tasks"), "--device", "cpu", "--batch_size", "1",
                          "--log_samples", "--output_path", str(tmp_path / "out")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    samples = [json.loads(line) for path in (tmp_path / "out").rglob("samples_tiny_local*.jsonl")
               for line in path.read_text().splitlines()]
    assert len(samples) == len(PAIRS)
    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(tokenizer_dir))
    for sample in samples:
        context, target = sample["arguments"]["gen_args_0"]["arg_0"], sample["arguments"]["gen_args_0"]["arg_1"]
        theirs = float(sample["resps"][0][0][0])
        assert abs(theirs - own_loglikelihood(model, tokenizer, context, target)) < 1e-4, (context, target)


MC_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question.strip()}}}}\\nA. {{{{choices[0]}}}}\\nB. {{{{choices[1]}}}}\\nC. {{{{choices[2]}}}}\\nD. {{{{choices[3]}}}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def mmlu_style_questions(count: int) -> list[dict]:
    """MMLU's record format (question, four choices, the answer's index), made up here."""
    g = torch.Generator().manual_seed(5)
    words = ["value", "key", "memory", "book", "token", "layer", "chunk", "window"]
    rows = []
    for i in range(count):
        picks = torch.randint(0, len(words), (5,), generator=g).tolist()
        rows.append({"question": f"Which {words[picks[0]]} follows item {i}?",
                     "choices": [f"the {words[p]}" for p in picks[1:]], "answer": i % 4})
    return rows


def own_choice_accuracy(folder, tokenizer, questions: list[dict]) -> list[float]:
    """Per question 1.0 when log p(' X' | prompt) is largest at the answer's letter, by the
    transformers model of `folder` and the project's tokenizer (BOS first, context + choice
    encoded whole, as lm_eval splits them)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    correct = []
    for q in questions:
        prompt = q["question"] + "".join(f"\n{letter}. {c}" for letter, c in zip("ABCD", q["choices"])) + "\nAnswer:"
        scores = []
        for letter in "ABCD":
            whole = tokenizer.encode(prompt + " " + letter, add_bos=True, add_eos=False)
            start = len(tokenizer.encode(prompt, add_bos=True, add_eos=False))
            with torch.no_grad():
                logp = model(torch.tensor([whole[:-1]])).logits[0].double().log_softmax(-1)
            scores.append(sum(logp[i - 1, whole[i]].item() for i in range(start, len(whole))))
        correct.append(float(max(range(4), key=scores.__getitem__) == q["answer"]))
    return correct


@pytest.mark.slow
def test_locas_forgetting_scores_the_merged_export_and_the_baseline_through_lm_eval(tokenizer_dir, tmp_path, capsys,
                                                                                   monkeypatch):
    """The Table 4 check offline: a debug Qwen3 memorises a book with Locas-GLU, its merged
    export and the untouched model go through lm_eval on a local MMLU-format task, and each
    accuracy and the paired change equal the argmax of the project's own log-likelihoods."""
    assert importlib.util.find_spec("lm_eval"), "lm_eval is missing: EXTRAS=eval bash scripts/setup.sh (test.sh does)"
    from conftest import load_script
    from test_backbone import qwen3_debug_checkpoint
    from torchtitan_ext.hf_export import export, import_weights

    qwen3_debug_checkpoint(tmp_path / "random")
    model, trainer_config = import_weights("train_configs.backbone", "backbone_qwen3_debug", tmp_path / "random")
    export(model, trainer_config, tmp_path / "base")  # the baseline, with the tokenizer beside it
    (tmp_path / "book.txt").write_text(" ".join(f"word{i % 37} of the book" for i in range(150)))
    load_script("eval_long_ppl").main([
        "--checkpoint", str(tmp_path / "base"), "--config", "train_configs.backbone:backbone_qwen3_debug",
        "--dataset", str(tmp_path / "book.txt"), "--split", "all", "--window", "64", "--probe-docs", "0",
        "--out", str(tmp_path / "ttt"), "--ttt", "locas_glu", "--ttt-rank", "8", "--ttt-lr", "1.0",
        "--merge-out", str(tmp_path / "merged")])
    questions = mmlu_style_questions(12)
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(MC_TASK.format(data=tmp_path / "mc.jsonl"))
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    locas_forgetting = load_script("locas_forgetting")
    locas_forgetting.main(["--model", f"baseline={tmp_path / 'base'}", "--model", f"locas_glu={tmp_path / 'merged'}",
                           "--tasks", "tiny_mc", "--include-path", str(tmp_path / "tasks"), "--out", str(tmp_path / "out")])
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(tokenizer_dir))
    own = {label: own_choice_accuracy(tmp_path / folder, tokenizer, questions)
           for label, folder in (("baseline", "base"), ("locas_glu", "merged"))}
    assert [r["model"] for r in rows] == ["baseline", "locas_glu"] and rows[0]["questions"] == 12
    for row in rows:
        assert row["acc"] == pytest.approx(sum(own[row["model"]]) / 12, abs=1e-9)
        assert row["acc_ci95"][0] <= row["acc"] <= row["acc_ci95"][1]
    assert rows[1]["delta"] == pytest.approx(rows[1]["acc"] - rows[0]["acc"], abs=1e-9)
    assert "| locas_glu |" in (tmp_path / "out" / "results.md").read_text()

    with pytest.raises(SystemExit) as stop:  # a folder that is not a Hugging Face model: one line, exit 2
        locas_forgetting.main(["--model", f"baseline={tmp_path}", "--tasks", "tiny_mc", "--out", str(tmp_path / "bad")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert stop.value.code == 2 and len(err) == 1 and "no config.json" in err[0]


def test_a_local_task_folder_holding_every_task_is_indexed_alone_and_once(tmp_path, monkeypatch):
    """lm_eval's own index of thousands of task YAMLs (~27 s) is built only for a task the
    folder does not hold, and each index once per process."""
    from torchtitan_ext.eval import zero_shot

    folder = str(zero_shot.write_cloze_task(tmp_path / "tasks", items=4))
    local = zero_shot.task_manager([zero_shot.CLOZE_TASK], folder)
    assert local.all_tasks == local.all_subtasks == [zero_shot.CLOZE_TASK]
    assert zero_shot.task_manager([zero_shot.CLOZE_TASK], folder) is local
    built = []
    monkeypatch.setattr(zero_shot, "_task_index", lambda path, defaults: built.append(defaults) or local)
    zero_shot.task_manager([zero_shot.CLOZE_TASK, "piqa"], folder)  # piqa is lm_eval's: the full index
    zero_shot.task_manager(["piqa"], None)
    assert built == [False, True, True]
