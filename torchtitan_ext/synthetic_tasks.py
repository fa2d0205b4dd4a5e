"""The synthetic memory tasks, generated (no download): the samples `scripts/eval_tasks.py`
scores and `torchtitan_ext/task_data.py` trains on.

- kv_retrieval: GradMem's associative retrieval (Kuratov et al., "GradMem: Learning to Write
  Context into Memory with Test-Time Gradient Descent", section 4): keys and values of 2
  symbols from 62 (letters and digits), unique keys, context `!k1:v1!!k2:v2!...|`, query
  `?!k:`, answer `v`; as many pairs as fit. Scored by exact match of the value.
- s_niah: RULER single needle (Cho et al., "MoNe: Modular Neural Memory for Efficient Long
  Context Inference", appendix A.1): one "The special magic value for <adjective-noun>
  is: <adjective-noun>." at a random depth of filler text; substring match.
- mk_niah: RULER multi-key needle: four such needles at scattered depths, one queried, the
  other three are distractors; substring match.
- fwe: RULER frequent-word extraction: 6-letter words drawn from a Zipf law (alpha 2), the
  top-ranked word replaced by a noise token; answer the 3 most frequent others; recall.
"""

from __future__ import annotations

import random
import string
from collections import Counter
from dataclasses import dataclass

from torchtitan_ext.errors import UserError

SYMBOLS = string.ascii_letters + string.digits  # GradMem's 62-symbol alphabet
ADJECTIVES = ["amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lucid",
              "mellow", "noble", "odd", "pale", "quiet", "rapid", "silent", "tidy", "upper", "vivid", "warm", "young"]
NOUNS = ["anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket", "kettle",
         "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tunnel", "violin", "walnut"]
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
NOISE_WORD = "zzzzzz"
TASKS = ("kv_retrieval", "s_niah", "mk_niah", "fwe")


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


def _haystack(rng: random.Random, chars: int, needles: list[str]) -> str:
    sentences = FILLER.split(". ")
    text = []
    while sum(map(len, text)) < chars:
        text.append(rng.choice(sentences).strip(". ") + ". ")
    for needle in needles:
        text.insert(rng.randrange(len(text) + 1), needle + " ")
    return "".join(text)


def niah(rng: random.Random, chars: int, n_needles: int) -> Sample:
    taken: set = set()
    pairs = [(_compound(rng, taken), _compound(rng, taken)) for _ in range(n_needles)]
    needles = [f"The special magic value for {k} is: {v}." for k, v in pairs]
    key, value = rng.choice(pairs)
    return Sample(_haystack(rng, chars, needles), f" What is the special magic value for {key}? "
                  f"The special magic value for {key} is:", [value])


def fwe(rng: random.Random, chars: int) -> Sample:
    vocabulary = ["".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(200)]
    weights = [1 / (rank + 1) ** 2.0 for rank in range(len(vocabulary))]
    words = rng.choices(vocabulary, weights=weights, k=max(10, chars // 7))
    words = [NOISE_WORD if w == vocabulary[0] else w for w in words]
    top = [w for w, _ in Counter(w for w in words if w != NOISE_WORD).most_common(3)]
    return Sample(" ".join(words), " Question: what are the three most frequent words above? Answer:", top)


def generate(task: str, rng: random.Random, chars: int) -> Sample:
    if task == "kv_retrieval":
        return kv_retrieval(rng, chars)
    if task == "fwe":
        return fwe(rng, chars)
    return niah(rng, chars, 1 if task == "s_niah" else 4)


def score(task: str, output: str, answers: list[str]) -> float:
    """kv_retrieval: exact match of the value (the output's first 2 non-space symbols);
    niah: the answer is a substring of the output; fwe: recall of the 3 words."""
    if task == "kv_retrieval":
        return float(output.strip()[:2] == answers[0])
    if task == "fwe":
        return sum(a in output for a in answers) / len(answers)
    return float(answers[0] in output)


def fit_sample(task: str, rng: random.Random, tokenizer, length: int):
    """(token ids: BOS, context, query; sample) of the longest sample of at most `length`
    tokens, its size in characters found by bisection (same random draws each try)."""
    state, best, low, high = rng.getstate(), None, 8, 4 * length
    for _ in range(12):
        chars = (low + high) // 2
        rng.setstate(state)
        sample = generate(task, rng, chars)
        ids = tokenizer.encode(sample.context + sample.query, add_bos=True, add_eos=False)
        if len(ids) <= length:
            best, low = (ids, sample), chars
        else:
            high = chars
    if best is None:
        raise UserError(f"context length {length} is too short for a {task} sample")
    return best
