"""Text sources for the Locas paper's evaluations (paper 000) that no Hub download provides here:

- **LoCoMo** (section 3.4; Maharana et al. 2024, `locomo10.json`): a JSON list of samples, each
  {"sample_id", "conversation": {"speaker_a", "speaker_b", "session_<k>": [{"speaker",
  "dia_id", "text", optional "blip_caption"}], "session_<k>_date_time": str, ...}, "qa":
  [{"question", "answer" (or "adversarial_answer" for category 5), "evidence", "category"}]}.
  `load_locomo` reads it into `Conversation`s, sessions in their numeric order; a dialogue's
  `text()` is what whole-book test-time training memorises (the paper's "conversation
  history"). Categories are kept as LoCoMo's numbers; LoCoMo's evaluation code names them
  1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial (CATEGORY_NAMES).
- **KJV books** (`kjv_books`): the 66 books of the King James Bible (public domain) from
  Debian's `bible-kjv` package (`apt-get install bible-kjv`; its `bible` program prints the
  text), one document per book: 35 of them are over 5,000 words, long documents no model
  here trained on, for the whole-book protocol's many-document runs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from torchtitan_ext.errors import UserError

CATEGORY_NAMES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
LOCOMO_FORMAT = ("expected LoCoMo's format (locomo10.json): a JSON list of samples, each with a 'conversation' of "
                 "'session_<k>' turn lists and a 'qa' list")


@dataclass
class QA:
    question: str
    answer: str  # the adversarial (trap) answer for category 5
    category: int
    evidence: list[str] = field(default_factory=list)


@dataclass
class Turn:
    speaker: str
    dia_id: str
    text: str


@dataclass
class Session:
    index: int
    date_time: str
    turns: list[Turn]


@dataclass
class Conversation:
    sample_id: str
    speakers: tuple[str, str]
    sessions: list[Session]
    qa: list[QA]

    def text(self) -> str:
        """The dialogue as plain text: per session a header with its date, then one
        'Speaker: text' line per turn (a shared image's caption in brackets)."""
        blocks = []
        for s in self.sessions:
            lines = [f"Session {s.index} ({s.date_time})" if s.date_time else f"Session {s.index}"]
            lines += [f"{t.speaker}: {t.text}" for t in s.turns]
            blocks.append("\n".join(lines))
        return "\n\n".join(blocks)


def _turn(raw, where: str) -> Turn:
    if not isinstance(raw, dict) or not {"speaker", "text"} <= raw.keys():
        raise ValueError(f"{where} is not a turn with 'speaker' and 'text'")
    caption = f" [shares an image: {raw['blip_caption']}]" if raw.get("blip_caption") else ""
    return Turn(str(raw["speaker"]), str(raw.get("dia_id", "")), str(raw["text"]) + caption)


def _conversation(raw, i: int) -> Conversation:
    if not isinstance(raw, dict) or not isinstance(raw.get("conversation"), dict) or not isinstance(raw.get("qa"), list):
        raise ValueError(f"sample {i} has no 'conversation' object and 'qa' list")
    conv = raw["conversation"]
    keys = sorted((int(m.group(1)), k) for k in conv if (m := re.fullmatch(r"session_(\d+)", k)))
    if not keys:
        raise ValueError(f"sample {i}'s conversation has no 'session_<k>' entries")
    sessions = []
    for index, key in keys:
        if not isinstance(conv[key], list):
            raise ValueError(f"sample {i}'s {key} is not a list of turns")
        turns = [_turn(t, f"sample {i}'s {key}[{j}]") for j, t in enumerate(conv[key])]
        sessions.append(Session(index, str(conv.get(f"{key}_date_time", "")), turns))
    qa = []
    for j, q in enumerate(raw["qa"]):
        answer = q.get("answer", q.get("adversarial_answer")) if isinstance(q, dict) else None
        if answer is None or "question" not in q or "category" not in q:
            raise ValueError(f"sample {i}'s qa[{j}] lacks 'question', 'category' or an answer")
        qa.append(QA(str(q["question"]), str(answer), int(q["category"]), [str(e) for e in q.get("evidence", [])]))
    speakers = (str(conv.get("speaker_a", "")), str(conv.get("speaker_b", "")))
    return Conversation(str(raw.get("sample_id", i)), speakers, sessions, qa)


def load_locomo(path: str | Path) -> list[Conversation]:
    """The conversations of a LoCoMo JSON file (module docstring); UserError naming the
    problem on a missing file or one of another format."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no LoCoMo file '{path}': give the path of locomo10.json (or a file of its format)")
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, list) or not raw:
            raise ValueError("the top level is not a non-empty list")
        return [_conversation(sample, i) for i, sample in enumerate(raw)]
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise UserError(f"'{path}' is not a LoCoMo file ({e}): {LOCOMO_FORMAT}") from None


KJV_BOOKS = ("Genesis Exodus Leviticus Numbers Deuteronomy Joshua Judges Ruth 1Samuel 2Samuel 1Kings 2Kings "
             "1Chronicles 2Chronicles Ezra Nehemiah Esther Job Psalms Proverbs Ecclesiastes Song Isaiah Jeremiah "
             "Lamentations Ezekiel Daniel Hosea Joel Amos Obadiah Jonah Micah Nahum Habakkuk Zephaniah Haggai "
             "Zechariah Malachi Matthew Mark Luke John Acts Romans 1Corinthians 2Corinthians Galatians Ephesians "
             "Philippians Colossians 1Thessalonians 2Thessalonians 1Timothy 2Timothy Titus Philemon Hebrews James "
             "1Peter 2Peter 1John 2John 3John Jude Revelation").split()


def kjv_book(name: str) -> str:
    """One book's text: its name, then one verse per line (references stripped)."""
    out = subprocess.run(["bible", "-f", f"{name}1:1-999:999"], capture_output=True, text=True, check=True).stdout
    verses = [line.split(" ", 1)[1] for line in out.splitlines() if " " in line]
    return name + "\n\n" + "\n".join(verses)


def kjv_books():
    """The 66 books of the King James Bible in canonical order (module docstring); UserError
    when Debian's `bible` program is missing."""
    if shutil.which("bible") is None:
        raise UserError("the kjv dataset needs Debian's bible-kjv package: apt-get install bible-kjv")
    for name in KJV_BOOKS:
        yield kjv_book(name)
