"""scripts/eval_tasks.py (torchtitan_ext/eval/tasks.py): the generated tasks, their scorers, and the CLI on
tiny checkpoints."""

from __future__ import annotations

import argparse
import json
import random
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import load_script
from torchtitan_ext.data import synthetic_tasks
from torchtitan_ext.training.checkpoints import build_model
from torchtitan_ext.eval import tasks
from torchtitan_ext.eval.long_ppl import Entry
from torchtitan_ext.paths import default_tokenizer_dir
from torchtitan_ext.data.tokenizer import AssetsTokenizer


def test_kv_retrieval_has_gradmem_format_unique_keys_and_the_answer_in_context():
    for seed in range(5):
        sample = synthetic_tasks.kv_retrieval(random.Random(seed), 300)
        pairs = re.findall(r"!(\w\w):(\w\w)!", sample.context)
        assert sample.context == "".join(f"!{k}:{v}!" for k, v in pairs) + "|"
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)) >= 40
        key = re.fullmatch(r"\?!(\w\w):", sample.query).group(1)
        assert dict(pairs)[key] == sample.answers[0]


@pytest.mark.parametrize("haystack", ["text", "noise"])
@pytest.mark.parametrize("task,needles", [("s_niah", 1), ("mk_niah", 4)])
def test_needles_are_planted_and_one_is_asked(task, needles, haystack):
    """Every needle whole in the context, one asked, its value and key nowhere else."""
    for seed in range(4):
        sample = synthetic_tasks.generate(task, random.Random(seed), 2000, haystack)
        found = re.findall(r"The special magic value for ([\w-]+) is: ([\w-]+)\.", sample.context)
        planted = dict(found)
        assert len(found) == len(planted) == needles and sample.context.count("magic value") == needles
        asked = re.search(r"value for ([\w-]+)\?", sample.query).group(1)
        assert planted[asked] == sample.answers[0]
        assert sample.context.count(asked) == 1 and sample.context.count(sample.answers[0]) == 1


def test_the_text_haystack_is_held_out_prose_and_noise_stays_the_filler():
    """Between the needles, the "text" haystack is the held-out embedded documents' text (a
    training document holds none of it), in order from a random start; different samples
    start elsewhere. "noise" is the filler's sentences only; by default MK-NIAH reads text,
    S-NIAH noise (the paper's appendix A.1)."""
    from torchtitan_ext.data.datasets import HELDOUT_PER_MILLE, is_heldout
    from torchtitan_ext.data.embedded_corpus import embedded_documents

    docs = embedded_documents()
    held = " ".join(" ".join(d.split()) for d in docs if is_heldout(d, HELDOUT_PER_MILLE["embedded"]))
    trained = [" ".join(d.split()) for d in docs if not is_heldout(d, HELDOUT_PER_MILLE["embedded"])]
    needle = r" ?The special magic value for [\w-]+ is: [\w-]+\. ?"
    starts = set()
    for seed in range(3):
        sample = synthetic_tasks.generate("mk_niah", random.Random(seed), 3000)
        assert sample.context == synthetic_tasks.generate("mk_niah", random.Random(seed), 3000, "text").context
        pieces = [p for p in re.split(needle, sample.context) if len(p) > 60]
        assert pieces and all(p.strip() in held and not any(p.strip() in t for t in trained) for p in pieces)
        starts.add(pieces[0][:40])
        assert 2800 < len(sample.context) < 3400
    assert len(starts) == 3
    sentences = set(synthetic_tasks.FILLER.split(". "))
    for task in ("s_niah", "mk_niah"):
        noise = synthetic_tasks.generate(task, random.Random(0), 600, None if task == "s_niah" else "noise")
        assert {s.strip(". ") for s in re.sub(needle, " ", noise.context).split(". ")} <= sentences


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
    """Mela streaming and two transformer checkpoints (two seeds of one label): one run per
    label, the seeds' figures beside the pooled one with its interval, in the JSON and the
    table; a question as a new segment is refused for a model without MoNe."""
    args = []
    for seed, (config, mode) in enumerate((("train_configs.mela:mela_debug", "streaming"),
                                           ("train_configs.transformer:transformer_small", "full"),
                                           ("train_configs.transformer:transformer_small", "full"))):
        torch.manual_seed(seed)
        model, _ = build_model(*config.split(":"))
        folder = tmp_path / f"{config.split(':')[1]}_{seed}"
        dcp.save(model.state_dict(), checkpoint_id=str(folder), no_dist=True)
        args += ["--checkpoint", str(folder), "--config", config, "--mode", mode]
    common = ["--context-lengths", "160", "--samples", "2", "--answer-tokens", "2", "--tasks", "s_niah,kv_retrieval"]
    load_script("eval_tasks").main(args + common + ["--out", str(tmp_path / "out")])
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    runs = results["runs"]
    assert [(r["mode"], r["question"], len(r["checkpoints"])) for r in runs] == [("streaming", "continue", 1),
                                                                                  ("full", "continue", 2)]
    scores = [v for r in runs for t in r["scores"].values() for v in t.values()]
    assert all(0 <= v["ci95"][0] <= v["pooled"] <= v["ci95"][1] <= 1 for v in scores)
    ppl = [v for r in runs for t in r["answer_ppl"].values() for v in t.values()]
    assert ppl and all(1 < v["ci95"][0] <= v["pooled"] <= v["ci95"][1] for v in ppl)
    two = runs[1]["answer_ppl"]["s_niah"]["160"]
    assert two["seeds"] == 2 and [s["items"] for s in two["per_seed"]] == [2, 2]
    assert two["per_seed"][0]["value"] != two["per_seed"][1]["value"]  # two different models
    assert min(s["value"] for s in two["per_seed"]) <= two["pooled"] <= max(s["value"] for s in two["per_seed"])
    table = (tmp_path / "out" / "results.md").read_text()
    assert table.count("; seeds ") == 4 and set(runs[0]["scores"]) == {"s_niah", "kv_retrieval"}
    assert (tmp_path / "out" / "tasks_vs_context.png").read_bytes()[:4] == b"\x89PNG"
    for bad, message in ((["--tasks", "passkey"], "unknown task(s) ['passkey']"),
                         (["--question", "new_segment"], "--question new_segment needs a model whose every block")):
        with pytest.raises(SystemExit) as stop:
            load_script("eval_tasks").main(args + common + bad + ["--out", str(tmp_path / "bad")])
        assert stop.value.code == 2 and message in capsys.readouterr().err
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

    monkeypatch.setattr(tasks, "entry_logits", confident_on_the_answer)
    assert tasks.answer_nll(None, full, start) < 1e-6
    assert tasks.answer_nll(None, full, start - 1) > 10


@pytest.mark.parametrize("query", [0, 19])
def test_a_streamed_answer_equals_re_reading_the_sequence(query):
    """Token-by-token decoding through the stream (a MoNe graft: segments, memory writes and
    a query crossing a segment boundary, or starting a new segment at 19) gives the greedy
    answer of re-reading everything, and the answer's NLL of one pass."""
    from models.backbones.decoder_lm import DecoderLM, DecoderLMConfig
    from models.grafts.graft import GraftConfig

    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig(architecture="qwen3", vocab_size=64, dim=32, n_layers=2, n_heads=4,
                                      n_kv_heads=2, head_dim=16, ffn_hidden=64, qk_norm=True,
                                      graft=GraftConfig(kind="mone", memory={"segment": 8}))).double().eval()
    ids = torch.randint(0, 64, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    full = Entry("full", model, "full", 64, 0, 1024)
    streaming = Entry("streaming", model, "streaming", 64, 5, 1024)
    assert tasks.answer(streaming, ids, 12, query) == tasks.answer(full, ids, 12, query)
    assert tasks.answer_nll(streaming, ids, 25, query) == pytest.approx(tasks.answer_nll(full, ids, 25, query),
                                                                             rel=1e-12)


@pytest.mark.parametrize("mode", ["full", "streaming"])
def test_the_eval_question_reads_the_context_only_through_the_memory(mode, tokenizer_dir):
    """eval_tasks' prompts (S-NIAH in noise, MK-NIAH in held-out text) on a random MoNe
    model, the question as a new segment (the default for MoNe): with writes disabled a
    changed context token (first, middle, last) leaves the question's logits exactly
    unchanged, with writes on it changes them."""
    from test_mone import awaken, tiny

    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(default_tokenizer_dir()))
    models = [awaken(tiny(segment=16, vocab=tokenizer.get_vocab_size())).eval() for _ in range(2)]
    for block in models[1].layers.values():
        block.memory_lr.bias.data.fill_(-800.0)
    written, unwritten = (Entry(mode, m, mode, 256, 24, 1024) for m in models)
    args = argparse.Namespace(question=None)
    assert tasks.questions(args, [(written, None)]) == ["new_segment"]
    for task in ("s_niah", "mk_niah"):
        ids, sample = synthetic_tasks.fit_sample(task, random.Random(task), tokenizer, 176)
        prompt, query, full, start = tasks.encode_prompt(task, sample, ids, tokenizer, "new_segment")
        assert full[:query] == prompt[:query] and query < start < len(full) and query % 16
        rows = torch.tensor([prompt] * 4)
        for row, where in enumerate((1, query // 2, query - 1), 1):
            rows[row, where] = (rows[row, where] + 1) % tokenizer.get_vocab_size()
        for entry, moved in ((unwritten, False), (written, True)):
            with torch.no_grad():
                logits = tasks.prompt_logits(entry, rows, query)[:, query:]
            for changed in logits[1:]:
                assert (changed - logits[0]).abs().amax(-1).min() > 1e-9 if moved else torch.equal(changed, logits[0])
