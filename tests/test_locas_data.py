"""Locas' evaluation texts (torchtitan_ext/data/locas_data.py): a LoCoMo file (the format of
locomo10.json, a small one written here) read into conversations and QA, wrong files refused
with one clear line; the KJV books of Debian's bible-kjv when it is installed; both reachable
as eval_long_ppl datasets."""

from __future__ import annotations

import json
import shutil

import pytest

from torchtitan_ext.errors import UserError
from torchtitan_ext.data.locas_data import CATEGORY_NAMES, KJV_BOOKS, kjv_books, load_locomo

SAMPLE = {
    "sample_id": "conv-1",
    "conversation": {
        "speaker_a": "Caroline", "speaker_b": "Melanie",
        "session_10_date_time": "9:00 am on 1 June, 2023",
        "session_10": [{"speaker": "Caroline", "dia_id": "D10:1", "text": "I adopted a dog."}],
        "session_2_date_time": "1:56 pm on 8 May, 2023",
        "session_2": [{"speaker": "Caroline", "dia_id": "D2:1", "text": "I went to a support group."},
                      {"speaker": "Melanie", "dia_id": "D2:2", "text": "Look at this!", "blip_caption": "a sunrise"}],
    },
    "qa": [{"question": "When did Caroline go to the support group?", "answer": "7 May 2023", "evidence": ["D2:1"],
            "category": 2},
           {"question": "What did Melanie adopt?", "adversarial_answer": "a dog", "evidence": ["D10:1"], "category": 5}],
    "event_summary": {}, "observation": {}, "session_summary": {},
}


def test_locomo_file_reads_into_sessions_in_numeric_order_and_qa(tmp_path):
    path = tmp_path / "locomo.json"
    path.write_text(json.dumps([SAMPLE, {**SAMPLE, "sample_id": "conv-2"}]))
    conversations = load_locomo(path)
    assert [c.sample_id for c in conversations] == ["conv-1", "conv-2"]
    first = conversations[0]
    assert first.speakers == ("Caroline", "Melanie")
    assert [s.index for s in first.sessions] == [2, 10]  # 2 before 10, not the keys' text order
    assert [t.dia_id for t in first.sessions[0].turns] == ["D2:1", "D2:2"]
    assert [(q.answer, q.category, q.evidence) for q in first.qa] == [("7 May 2023", 2, ["D2:1"]), ("a dog", 5, ["D10:1"])]
    assert CATEGORY_NAMES[first.qa[1].category] == "adversarial"
    text = first.text()
    assert text.index("I went to a support group.") < text.index("I adopted a dog.")
    assert "Session 2 (1:56 pm on 8 May, 2023)\nCaroline: I went to a support group." in text
    assert "Melanie: Look at this! [shares an image: a sunrise]" in text


@pytest.mark.parametrize("content,message", [
    ("not json", "is not a LoCoMo file"),
    (json.dumps({"conversation": {}}), "top level is not a non-empty list"),
    (json.dumps([{"qa": []}]), "sample 0 has no 'conversation' object and 'qa' list"),
    (json.dumps([{**SAMPLE, "conversation": {"speaker_a": "A"}}]), "no 'session_<k>' entries"),
    (json.dumps([{**SAMPLE, "qa": [{"question": "?", "category": 1}]}]), "qa[0] lacks"),
])
def test_a_wrong_locomo_file_is_one_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(UserError, match="LoCoMo") as error:
        load_locomo(path)
    assert message in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(UserError, match="no LoCoMo file"):
        load_locomo(tmp_path / "missing.json")


def test_eval_long_ppl_reads_locomo_dialogues_as_documents(tmp_path):
    from torchtitan_ext.eval.long_ppl import documents

    path = tmp_path / "locomo.json"
    path.write_text(json.dumps([SAMPLE]))
    docs = list(documents(f"locomo:{path}"))
    assert docs == [load_locomo(path)[0].text()]


@pytest.mark.skipif(shutil.which("bible") is None, reason="Debian's bible-kjv is not installed (apt-get install bible-kjv)")
def test_kjv_gives_the_66_books_in_order_with_many_long_ones():
    books = list(kjv_books())
    assert len(books) == len(KJV_BOOKS) == 66
    assert books[0].startswith("Genesis\n\nIn the beginning God created the heaven and the earth.")
    assert books[-1].rstrip().endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert not any(line[:1].isdigit() and ":" in line.split(" ")[0] for b in books for line in b.splitlines())
    assert sum(len(b.split()) >= 6000 for b in books) >= 30  # >= 8K tokens each with the debug tokenizer
