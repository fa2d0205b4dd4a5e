"""scripts/eval_tasks.py: the generated tasks, their scorers, and the CLI on tiny checkpoints."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

import eval_tasks
from torchtitan_ext import synthetic_tasks
from torchtitan_ext.checkpoints import build_model
from torchtitan_ext.paths import default_tokenizer_dir
from torchtitan_ext.tokenizer import AssetsTokenizer


def test_kv_retrieval_has_gradmem_format_unique_keys_and_the_answer_in_context():
    for seed in range(5):
        sample = synthetic_tasks.kv_retrieval(random.Random(seed), 300)
        pairs = re.findall(r"!(\w\w):(\w\w)!", sample.context)
        assert sample.context == "".join(f"!{k}:{v}!" for k, v in pairs) + "|"
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)) >= 40
        key = re.fullmatch(r"\?!(\w\w):", sample.query).group(1)
        assert dict(pairs)[key] == sample.answers[0]


@pytest.mark.parametrize("task,needles", [("s_niah", 1), ("mk_niah", 4)])
def test_needles_are_planted_and_one_is_asked(task, needles):
    sample = synthetic_tasks.generate(task, random.Random(1), 2000)
    planted = dict(re.findall(r"The special magic value for ([\w-]+) is: ([\w-]+)\.", sample.context))
    assert len(planted) == needles
    asked = re.search(r"value for ([\w-]+)\?", sample.query).group(1)
    assert planted[asked] == sample.answers[0]


def test_frequent_words_are_the_top_three_without_the_noise_word():
    sample = synthetic_tasks.fwe(random.Random(2), 3000)
    counts = {w: sample.context.split().count(w) for w in set(sample.context.split())}
    assert synthetic_tasks.NOISE_WORD in counts and max(counts, key=counts.get) == synthetic_tasks.NOISE_WORD
    del counts[synthetic_tasks.NOISE_WORD]
    assert sorted(counts, key=counts.get, reverse=True)[:3] == sample.answers


@pytest.mark.parametrize("task,output,answers,expected", [
    ("kv_retrieval", " aB!|", ["aB"], 1.0), ("kv_retrieval", "ab", ["aB"], 0.0),
    ("s_niah", " calm-river and more", ["calm-river"], 1.0), ("mk_niah", "calm-rive", ["calm-river"], 0.0),
    ("fwe", "abcdef qwerty", ["abcdef", "qwerty", "zxcvbn"], 2 / 3),
])
def test_scorers(task, output, answers, expected):
    assert synthetic_tasks.score(task, output, answers) == pytest.approx(expected)


@pytest.mark.parametrize("task", synthetic_tasks.TASKS)
def test_samples_fit_the_context_length(task, tokenizer_dir):
    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(default_tokenizer_dir()))
    ids, sample = synthetic_tasks.fit_sample(task, random.Random(3), tokenizer, 256)
    assert 200 <= len(ids) <= 256 and sample.answers


def test_cli_writes_results_for_several_checkpoints_and_rejects_unknown_tasks(tokenizer_dir, tmp_path, capsys):
    args = []
    for config, mode in (("train_configs.mela:mela_debug", "streaming"), ("train_configs.transformer:transformer_small", "full")):
        torch.manual_seed(0)
        model, _ = build_model(*config.split(":"))
        folder = tmp_path / config.split(":")[1]
        dcp.save(model.state_dict(), checkpoint_id=str(folder), no_dist=True)
        args += ["--checkpoint", str(folder), "--config", config, "--mode", mode]
    common = ["--context-lengths", "160", "--samples", "1", "--answer-tokens", "2"]
    eval_tasks.main(args + common + ["--out", str(tmp_path / "out")])
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["mode"] for r in results["runs"]] == ["streaming", "full"]
    assert all(0 <= v <= 1 for r in results["runs"] for t in r["scores"].values() for v in t.values())
    intervals = [v for r in results["runs"] for t in r["answer_ppl"].values() for v in t.values()]
    assert intervals and all(1 < low <= ppl <= high for ppl, low, high in intervals)
    assert set(results["runs"][0]["scores"]) == set(synthetic_tasks.TASKS)
    assert (tmp_path / "out" / "tasks_vs_context.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit) as stop:
        eval_tasks.main(args + common + ["--tasks", "passkey", "--out", str(tmp_path / "bad")])
    assert stop.value.code == 2 and "unknown task(s) ['passkey']" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_answer_nll_counts_the_answer_and_eos_tokens_only(monkeypatch):
    """Logits sure of every answer token and wrong everywhere before: NLL 0 from the first
    answer token on; counting one prompt token more makes it large."""
    full, start = [1, 5, 6, 7, 8, 2], 4  # BOS, prompt 5 6 7, answer 8, EOS 2

    def confident_on_the_answer(entry, tokens):
        logits = torch.zeros(1, tokens.shape[1], 16)
        for i in range(tokens.shape[1]):
            logits[0, i, full[i + 1]] = 50.0 if i >= start - 1 else -50.0
        return logits

    monkeypatch.setattr(eval_tasks, "entry_logits", confident_on_the_answer)
    assert eval_tasks.answer_nll(None, full, start) < 1e-6
    assert eval_tasks.answer_nll(None, full, start - 1) > 10


def test_a_streamed_answer_equals_re_reading_the_sequence():
    """Token-by-token decoding through the stream (a MoNe graft: segments, memory writes and
    a query crossing a segment boundary) gives the greedy answer of re-reading everything."""
    from eval_long_ppl import Entry
    from models.backbones.decoder_lm import DecoderLM, DecoderLMConfig
    from models.grafts.graft import GraftConfig

    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig(architecture="qwen3", vocab_size=64, dim=32, n_layers=2, n_heads=4,
                                      n_kv_heads=2, head_dim=16, ffn_hidden=64, qk_norm=True,
                                      graft=GraftConfig(kind="mone", memory={"segment": 8}))).double().eval()
    ids = torch.randint(0, 64, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    full = Entry("full", model, "full", 64, 0, 1024)
    streaming = Entry("streaming", model, "streaming", 64, 5, 1024)
    assert eval_tasks.answer(streaming, ids, 12) == eval_tasks.answer(full, ids, 12)
