"""The synthetic memory tasks, generated (no download): the samples `scripts/eval_tasks.py`
scores and `torchtitan_ext/data/task_data.py` trains on.

- kv_retrieval: GradMem's associative retrieval (Kuratov et al., "GradMem: Learning to Write
  Context into Memory with Test-Time Gradient Descent", section 4): keys and values of 2
  symbols from 62 (letters and digits), unique keys, context `!k1:v1!!k2:v2!...|`, query
  `?!k:`, answer `v`; as many pairs as fit. Scored by exact match of the value.
- s_niah: RULER single needle (Cho et al., "MoNe: Modular Neural Memory for Efficient Long
  Context Inference", appendix A.1): one "The special magic value for <adjective-noun>
  is: <adjective-noun>." at a random depth of filler text; substring match.
- mk_niah: RULER multi-key needle: four such needles at scattered depths of essay text, one
  queried, the other three are distractors; substring match.

The needles' haystack (`HAYSTACKS`): "noise", RULER's repeated filler sentences ("The grass
is green. ..."), or "text", real prose that training never reads, as RULER's Paul Graham
essays: the held-out documents of the embedded corpus (torchtitan_ext/data/datasets.py's
`embedded_validation`: CPython's help topics and docstrings, 53K characters, about 13K
tokens, whitespace collapsed), cut into sentences (and long ones at words, at most
`MAX_PIECE` characters), read in order from a random sentence, wrapping around (a longer
haystack repeats it). By default each task takes the paper's (appendix A.1: S-NIAH "filler
text", MK-NIAH "essay excerpts"): s_niah noise, mk_niah text (`PAPER_HAYSTACK`).
- fwe: RULER frequent-word extraction: 6-letter words drawn from a Zipf law (alpha 2), the
  top-ranked word replaced by a noise token; answer the 3 most frequent others; recall.
"""

from __future__ import annotations

import random
import re
import string
import textwrap
from collections import Counter
from dataclasses import dataclass
from functools import cache

from torchtitan_ext.errors import UserError

SYMBOLS = string.ascii_letters + string.digits  # GradMem's 62-symbol alphabet
ADJECTIVES = ["amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lucid",
              "mellow", "noble", "odd", "pale", "quiet", "rapid", "silent", "tidy", "upper", "vivid", "warm", "young"]
NOUNS = ["anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket", "kettle",
         "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tunnel", "violin", "walnut"]
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
NOISE_WORD = "zzzzzz"
TASKS = ("kv_retrieval", "s_niah", "mk_niah", "fwe")
HAYSTACKS = ("text", "noise")
PAPER_HAYSTACK = {"s_niah": "noise", "mk_niah": "text"}  # appendix A.1 (RULER's niah_single_1 / niah_multikey_1)
MAX_PIECE = 250  # characters: held-out sentences longer than this are cut at words


@dataclass
class Sample:
    context: str
    query: str
    answers: list[str]  # kv / niah: one; fwe: the three words


def _compound(rng: random.Random, taken: set) -> str:
    while (word := f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}") in taken:
        pass
    taken.add(word)
    return word


def kv_retrieval(rng: random.Random, chars: int) -> Sample:
    """About `chars` characters of `!k:v!` pairs (one character is about one token here)."""
    return kv_pairs(rng, max(2, (chars - 8) // 6))


def kv_pairs(rng: random.Random, n_pairs: int) -> Sample:
    """KV-retrieval with exactly `n_pairs` pairs (GradMem's Table 1 counts them)."""
    keys = rng.sample([a + b for a in SYMBOLS for b in SYMBOLS], n_pairs)
    values = ["".join(rng.choices(SYMBOLS, k=2)) for _ in keys]
    j = rng.randrange(n_pairs)
    context = "".join(f"!{k}:{v}!" for k, v in zip(keys, values)) + "|"
    return Sample(context, f"?!{keys[j]}:", [values[j]])


@cache
def heldout_sentences() -> tuple[str, ...]:
    """The "text" haystack's pieces (module docstring), in corpus order."""
    from torchtitan_ext.data.datasets import HELDOUT_PER_MILLE, is_heldout
    from torchtitan_ext.data.embedded_corpus import embedded_documents

    text = " ".join(" ".join(d.split()) for d in embedded_documents() if is_heldout(d, HELDOUT_PER_MILLE["embedded"]))
    return tuple(piece for sentence in re.split(r"(?<=[.!?])\s+", text) for piece in textwrap.wrap(sentence, MAX_PIECE))


def _haystack(rng: random.Random, chars: int, needles: list[str], haystack: str) -> str:
    """About `chars` characters of the haystack's sentences (noise: at least `chars`; text:
    the last sentence cut at a word), each needle inserted between two of them at a random
    depth."""
    if haystack == "noise":
        sentences = FILLER.split(". ")

        def draw():
            return rng.choice(sentences).strip(". ") + ". "
    else:
        pieces = heldout_sentences()
        start = rng.randrange(len(pieces))

        def draw():
            return pieces[(start + len(text)) % len(pieces)] + " "
    text, size = [], 0
    while size < chars:
        text.append(draw())
        size += len(text[-1])
    if haystack == "text":  # its pieces are long: the last one cut to `chars` at a word
        text[-1] = text[-1][:len(text[-1]) - (size - chars)].rpartition(" ")[0] + " "
    for needle in needles:
        text.insert(rng.randrange(len(text) + 1), needle + " ")
    return "".join(text)


def niah(rng: random.Random, chars: int, n_needles: int, haystack: str) -> Sample:
    """`n_needles` needles of distinct keys and values in the `haystack` (`HAYSTACKS`), one asked."""
    taken: set = set()
    pairs = [(_compound(rng, taken), _compound(rng, taken)) for _ in range(n_needles)]
    needles = [f"The special magic value for {k} is: {v}." for k, v in pairs]
    key, value = rng.choice(pairs)
    return Sample(_haystack(rng, chars, needles, haystack), f" What is the special magic value for {key}? "
                  f"The special magic value for {key} is:", [value])


def fwe(rng: random.Random, chars: int) -> Sample:
    vocabulary = ["".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(200)]
    weights = [1 / (rank + 1) ** 2.0 for rank in range(len(vocabulary))]
    words = rng.choices(vocabulary, weights=weights, k=max(10, chars // 7))
    words = [NOISE_WORD if w == vocabulary[0] else w for w in words]
    top = [w for w, _ in Counter(w for w in words if w != NOISE_WORD).most_common(3)]
    return Sample(" ".join(words), " Question: what are the three most frequent words above? Answer:", top)


def check_haystack(haystack: str | None) -> None:
    """UserError unless `haystack` is None (each task's `PAPER_HAYSTACK`) or one of `HAYSTACKS`."""
    if haystack is not None and haystack not in HAYSTACKS:
        raise UserError(f"unknown haystack '{haystack}': choose from {list(HAYSTACKS)}")


def generate(task: str, rng: random.Random, chars: int, haystack: str | None = None) -> Sample:
    """A sample of about `chars` characters of context; `haystack` for the needle tasks
    (None: the task's `PAPER_HAYSTACK`)."""
    if task == "kv_retrieval":
        return kv_retrieval(rng, chars)
    if task == "fwe":
        return fwe(rng, chars)
    return niah(rng, chars, 1 if task == "s_niah" else 4, haystack or PAPER_HAYSTACK[task])


def score(task: str, output: str, answers: list[str]) -> float:
    """kv_retrieval: exact match of the value (the output's first 2 non-space symbols);
    niah: the answer is a substring of the output; fwe: recall of the 3 words."""
    if task == "kv_retrieval":
        return float(output.strip()[:2] == answers[0])
    if task == "fwe":
        return sum(a in output for a in answers) / len(answers)
    return float(answers[0] in output)


def fit_sample(task: str, rng: random.Random, tokenizer, length: int, haystack: str | None = None):
    """(token ids: BOS, context, query; sample) of the longest sample of at most `length`
    tokens, its size in characters found by bisection (same random draws each try)."""
    state, best, low, high = rng.getstate(), None, 8, 4 * length
    for _ in range(12):
        chars = (low + high) // 2
        rng.setstate(state)
        sample = generate(task, rng, chars, haystack)
        ids = tokenizer.encode(sample.context + sample.query, add_bos=True, add_eos=False)
        if len(ids) <= length:
            best, low = (ids, sample), chars
        else:
            high = chars
    if best is None:
        raise UserError(f"context length {length} is too short for a {task} sample")
    return best
