"""BABILong (torchtitan_ext/eval/babilong.py, scripts/eval_tasks.py --tasks babilong): the
official files in each layout, the refusals, the generator's answers against an independent
solver of the story facts, the thesis' protocol, end to end on tiny MemoryLlama and MoNe
checkpoints."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import load_script
from torchtitan_ext.training.checkpoints import build_model
from torchtitan_ext.errors import UserError
from torchtitan_ext.eval import babilong, tasks
from torchtitan_ext.eval.long_ppl import Entry
from torchtitan_ext.paths import default_tokenizer_dir
from torchtitan_ext.data.tokenizer import AssetsTokenizer


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(default_tokenizer_dir()))


def rows(task: str, length: str, count: int = 4) -> list[dict]:
    return [{"input": f"Context {task} {length} number {i}.", "question": f"Where is item {i}?",
             "target": f"{task}-{length}-{i}"} for i in range(count)]


def write_official(root, layout: str, tasks=("qa1", "qa10"), lengths=("0k", "2k")) -> None:
    """A tiny BABILong folder in one of the Hugging Face layouts (qa10 beside qa1, so a reader
    matching qa1 as a prefix would mix them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, DatasetDict

    for length in lengths:
        if layout == "save_to_disk":
            DatasetDict({t: Dataset.from_list(rows(t, length)) for t in tasks}).save_to_disk(str(root / length))
            continue
        for task in tasks:
            table = pa.Table.from_pylist(rows(task, length))
            path = {"babilong": root / task / f"{length}-00000-of-00001.parquet",
                    "babilong-1k-samples": root / length / f"{task}-00000-of-00001.parquet",
                    "parquet-converter": root / length / task / "0000.parquet",
                    "jsonl": root / length / f"{task}.jsonl"}[layout]
            path.parent.mkdir(parents=True, exist_ok=True)
            if layout == "jsonl":
                path.write_text("".join(json.dumps(r) + "\n" for r in rows(task, length)))
            else:
                pq.write_table(table, path)


@pytest.mark.parametrize("layout", ["babilong", "babilong-1k-samples", "parquet-converter", "save_to_disk", "jsonl"])
def test_babilong_reader_takes_the_first_rows_of_each_split_in_every_layout(tmp_path, layout):
    write_official(tmp_path, layout)
    read = babilong.read_official(tmp_path, ["qa1", "qa10"], ["2k", "0k"], 3)
    assert sorted(read) == [("qa1", "0k"), ("qa1", "2k"), ("qa10", "0k"), ("qa10", "2k")]
    for (task, length), samples in read.items():
        assert [s.answers for s in samples] == [[f"{task}-{length}-{i}"] for i in range(3)]
        first = samples[0]
        assert first.context == f"<context>\nContext {task} {length} number 0.\n</context>\n"
        assert first.query == "Question: Where is item 0?\nAnswer:"


def test_babilong_reader_refuses_a_missing_task_or_length_or_field(tmp_path):
    write_official(tmp_path, "babilong", tasks=("qa1", "qa2"), lengths=("2k",))
    with pytest.raises(UserError, match=r"has no qa1 at 4k, qa2 at 4k, qa3 at 2k, qa3 at 4k: download"):
        babilong.read_official(tmp_path, ["qa1", "qa2", "qa3"], ["2k", "4k"], 5)
    with pytest.raises(UserError, match="does not exist"):
        babilong.read_official(tmp_path / "nowhere", ["qa1"], ["2k"], 5)
    (tmp_path / "qa4").mkdir()
    (tmp_path / "qa4" / "2k.jsonl").write_text(json.dumps({"input": "x", "question": "y"}) + "\n")
    with pytest.raises(UserError, match="has no field target"):
        babilong.read_official(tmp_path, ["qa4"], ["2k"], 5)


def test_babilong_length_names():
    assert babilong.length_tokens("2k") == 2048 and babilong.length_tokens("300") == 300
    assert babilong.length_name("4096") == "4k" and babilong.length_name("0k") == "0k"
    with pytest.raises(UserError, match="multiples of 1024"):
        babilong.length_name("1000")
    with pytest.raises(UserError, match="not a number of tokens"):
        babilong.length_tokens("2K tokens")


def test_babilong_cli_with_a_folder_missing_a_task_exits_2_before_loading_anything(tmp_path, capsys):
    write_official(tmp_path / "data", "babilong-1k-samples", tasks=("qa1",), lengths=("2k",))
    with pytest.raises(SystemExit) as stop:
        load_script("eval_tasks").main(["--checkpoint", str(tmp_path / "no-checkpoint"), "--config",
                                        "train_configs.backbone:mone_debug", "--tasks", "babilong", "--babilong-path",
                                        str(tmp_path / "data"), "--babilong-tasks", "qa1,qa2", "--context-lengths",
                                        "2048", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and "has no qa2 at 2k" in err[0]
    assert not (tmp_path / "out").exists()


# An independent reader of the story facts (its own patterns; shares nothing with the generator).
PATTERNS = {
    "move": re.compile(r"(\w+) (?:moved|went|journeyed|travelled|went back) to the (\w+)\."),
    "take": re.compile(r"(\w+) (?:picked up|got|grabbed|took) the (\w+) there\."),
    "drop": re.compile(r"(\w+) (?:dropped|discarded|put down|left) the (\w+)\."),
    "give": re.compile(r"(\w+) (?:gave|handed|passed) the (\w+) to (\w+)\."),
    "side": re.compile(r"The (\w+) is (north|south|east|west) of the (\w+)\."),
}
FLIP = {"north": "south", "south": "north", "east": "west", "west": "east"}


def solve(facts: list[str], question: str) -> tuple[str, set]:
    """(the answer the facts imply, every name the facts mention); asserts the answer is unique."""
    at, carrier, lying, seen, gifts, sides, names = {}, {}, {}, {}, [], set(), set()
    spot = lambda thing: at[carrier[thing]] if thing in carrier else lying.get(thing)  # noqa: E731
    for fact in facts:
        kind, match = next((k, m) for k, p in PATTERNS.items() if (m := p.fullmatch(fact)))
        names |= set(match.groups()) - set(FLIP)
        if kind == "move":
            at[match[1]] = match[2]
        elif kind == "take":
            carrier[match[2]] = match[1]
            lying.pop(match[2], None)
        elif kind == "drop":
            lying[match[2]] = at[match[1]]
            del carrier[match[2]]
        elif kind == "give":
            carrier[match[2]] = match[3]
            gifts.append(match.groups())
        else:
            sides |= {(match[1], match[2], match[3]), (match[3], FLIP[match[2]], match[1])}
        for thing in set(carrier) | set(lying):
            if not seen.get(thing) or seen[thing][-1] != spot(thing):
                seen.setdefault(thing, []).append(spot(thing))

    def one(answers) -> str:
        assert len(set(answers)) == 1, (question, answers)
        return answers[0]

    asked = [(r"Where is (\w+)\?", lambda p: at[p]), (r"Where is the (\w+)\?", spot),
             (r"Where was the (\w+) before the (\w+)\?", lambda t, p: seen[t][one([i for i, s in enumerate(seen[t]) if s == p]) - 1]),
             (r"What is (\w+) of the (\w+)\?", lambda d, y: one([a for a, s, b in sides if (s, b) == (d, y)])),
             (r"What is the (\w+) (\w+) of\?", lambda x, d: one([b for a, s, b in sides if (a, s) == (x, d)])),
             (r"Who gave the (\w+)\?", lambda t: one([g for g, o, r in gifts if o == t])),
             (r"Who received the (\w+)\?", lambda t: one([r for g, o, r in gifts if o == t])),
             (r"Who did (\w+) give the (\w+) to\?", lambda p, t: one([r for g, o, r in gifts if (g, o) == (p, t)])),
             (r"Who gave the (\w+) to (\w+)\?", lambda t, p: one([g for g, o, r in gifts if (o, r) == (t, p)])),
             (r"What did (\w+) give to (\w+)\?", lambda p, q: one([o for g, o, r in gifts if (g, r) == (p, q)]))]
    for pattern, answer in asked:
        if match := re.fullmatch(pattern, question):
            return answer(*match.groups()), names
    raise AssertionError(f"unknown question {question!r}")


@pytest.mark.parametrize("task", babilong.GENERATED_TASKS)
def test_babilong_generator_answers_what_the_facts_imply_and_hides_them_in_order(task, tokenizer):
    """60 stories per task: the independent solver finds the generator's answer (and only it);
    the facts stand in the context in order; the haystack around them names nobody and
    nothing of the story; the prompt stays within the length."""
    rng = random.Random(f"solver-{task}")
    for i in range(60):
        story = babilong.story(task, rng)
        answer, names = solve(story.facts, story.question)
        assert answer == story.answer
        ids, item = babilong.hide(story, rng, tokenizer, 0 if i % 4 == 0 else 400)
        assert len(ids) <= 400 and item.answers == [story.answer] and story.question in item.query
        rest, position = item.context, 0
        for fact in story.facts:
            position = rest.index(fact, position)
            rest = rest[:position] + rest[position + len(fact):]
        assert not re.search(r"\b(" + "|".join(sorted(names)) + r")\b", rest), rest
    assert len({babilong.story(task, rng).answer for _ in range(30)}) > 2  # the answers vary


def test_babilong_generator_is_deterministic_and_fills_the_length(tokenizer):
    first = babilong.items(["qa2", "qa4"], ["1024", "0k"], 3, 7, tokenizer)
    again = babilong.items(["qa2", "qa4"], ["1024", "0k"], 3, 7, tokenizer)
    other = babilong.items(["qa2", "qa4"], ["1024", "0k"], 3, 8, tokenizer)
    assert [ids for rows in first.values() for ids, _ in rows] == [ids for rows in again.values() for ids, _ in rows]
    assert [ids for rows in first.values() for ids, _ in rows] != [ids for rows in other.values() for ids, _ in rows]
    for (task, length), rows in first.items():
        for ids, item in rows:
            if length == "0k":  # the story alone: nothing but facts between the tags
                inside = item.context.removeprefix("<context>\n").removesuffix("\n</context>\n")
                sentences = re.split(r"(?<=\.) ", inside)
                assert all(any(p.fullmatch(s) for p in PATTERNS.values()) for s in sentences), inside
                assert len(ids) < 300
            else:
                assert 870 <= len(ids) <= 1024
    with pytest.raises(UserError, match="too short for this"):
        babilong.items(["qa2"], ["20"], 1, 0, tokenizer)


def test_babilong_scores_a_substring_of_the_output_and_resets_the_memory_per_sample(tokenizer):
    """The thesis' criterion on a given output; a real MemoryLlama stream (memory awake): a
    sample's output is the same whether another sample came before it or not."""
    from test_memory_llama import awaken, tiny

    said = tokenizer.encode(" the kitchen.", add_bos=False, add_eos=False)
    cells = {("qa1", "0k"): [([1, 5], babilong.sample("Mary went to the kitchen.", "Where is Mary?", target))
                             for target in ("kitchen", "garden", "the kitchen", "Kitchen")]}
    scored = babilong.evaluate(lambda ids, query: said, cells, tokenizer)
    assert scored["qa1"]["0k"]["correct"] == [1, 0, 1, 0]
    assert scored["qa1"]["0k"]["outputs"] == [tokenizer.decode(said)] * 4

    model = awaken(tiny(chunk=8)).eval()
    entry = Entry("alma", model, "streaming", 64, 8, 1024)
    a, b = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(5)).tolist()
    generate = lambda ids, query: tasks.answer(entry, ids, 4, query)  # noqa: E731
    item = cells["qa1", "0k"][0][1]
    both = babilong.evaluate(generate, {("qa1", "0k"): [(a, item), (b, item)]}, tokenizer)["qa1"]["0k"]["outputs"]
    alone = babilong.evaluate(generate, {("qa1", "0k"): [(b, item)]}, tokenizer)["qa1"]["0k"]["outputs"]
    assert both[1] == alone[0] and both[0] != alone[0]


def test_babilong_cli_on_memoryllama_mone_and_the_backbone_writes_the_thesis_table(tokenizer_dir, tmp_path):
    """Offline, streaming: generated qa4 stories alone (0k) and in 100 tokens, one sample,
    4 greedy tokens; two backbone checkpoints under one label are its two seeds; MoNe reads
    the question as a new segment, the others right after the context."""
    args = []
    for seed, config, label in ((0, "memoryllama_alma_debug", "alma"), (0, "mone_debug", "mone"),
                                (0, "backbone_qwen3_debug", "backbone"), (1, "backbone_qwen3_debug", "backbone")):
        torch.manual_seed(seed)
        model, _ = build_model("train_configs.backbone", config)
        folder = tmp_path / f"{config}-{seed}"
        dcp.save(model.state_dict(), checkpoint_id=str(folder), no_dist=True)
        args += ["--checkpoint", str(folder), "--config", f"train_configs.backbone:{config}", "--label", label,
                 "--mode", "streaming"]
    load_script("eval_tasks").main(args + ["--tasks", "babilong", "--babilong-tasks", "qa4", "--context-lengths",
                                           "0k,100", "--samples", "1", "--answer-tokens", "4", "--out",
                                           str(tmp_path / "out")])
    results = json.loads((tmp_path / "out" / "babilong.json").read_text())
    assert results["answer_tokens"] == 4 and results["samples"] == 1 and results["lengths"] == ["0k", "100"]
    assert [(m["label"], m["question"], len(m["seeds"])) for m in results["models"]] == [
        ("alma", "continue", 1), ("mone", "new_segment", 1), ("backbone", "continue", 2)]
    for model in results["models"]:
        for length in ("0k", "100"):
            cell = model["accuracy"]["qa4"][length]
            correct = [c for seed in model["seeds"] for c in seed["cells"]["qa4"][length]["correct"]]
            assert cell["pooled"] == pytest.approx(sum(correct) / len(correct))
            assert cell["ci95"][0] <= cell["pooled"] <= cell["ci95"][1] and len(cell["per_seed"]) == len(model["seeds"])
    table = (tmp_path / "out" / "babilong.md").read_text()
    assert re.search(r"^\| backbone \| streaming \| continue \| qa4 \| \d+ \(\d+-\d+\); seeds \d+, \d+ \| ", table, re.M)
    assert re.search(r"^\| mone \| streaming \| new_segment \| qa4 \| \d+ \(\d+-\d+\) \| \d+ \(\d+-\d+\) \|$", table, re.M)
    assert (tmp_path / "out" / "babilong.png").read_bytes()[:4] == b"\x89PNG"
