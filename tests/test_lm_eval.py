"""The Hugging Face exports under lm-evaluation-harness (`lm_eval --model hf`, the `eval`
extra): a tiny local task (written here, no download) on a tiny Mela export, and lm_eval's
log-likelihoods equal the project's own for the same tokens."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from test_hf import native, run_script
from torchtitan_ext.checkpoints import causal_logits
from torchtitan_ext.tokenizer import AssetsTokenizer

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
