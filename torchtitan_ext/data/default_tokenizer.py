"""The offline default tokenizer: sentencepiece BPE, 4096 pieces, trained once on the embedded corpus.

Lossless, as Llama's: no normalisation (identity rule, whitespace kept: code keeps its
newlines and indentation), a dummy prefix space, digits split, unknown characters as UTF-8
bytes; so `transformers`' LlamaTokenizer reads the same `tokenizer.model` to the same ids
(the Hugging Face export writes the tokenizer_config.json that says so; tests/test_hf.py).

`build()` is idempotent (returns at once when the model is cached) and atomic (concurrent
builders are safe). `scripts/build_tokenizer.py` runs it; so does the preflight of a
training run whose `--hf_assets_path` is the default folder, so a fresh clone trains
without a separate step.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from torchtitan_ext.data.embedded_corpus import embedded_documents
from torchtitan_ext.paths import default_tokenizer_dir

VOCAB_SIZE = 4096


def build(out: Path | None = None, vocab_size: int = VOCAB_SIZE) -> Path:
    """Path of `<out>/tokenizer.model` (default: `default_tokenizer_dir()`), trained if absent."""
    import sentencepiece as spm

    out = Path(out or default_tokenizer_dir())
    model = out / "tokenizer.model"
    if model.is_file():
        return model
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(embedded_documents()), encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(Path(tmp) / "tokenizer"), vocab_size=vocab_size,
            model_type="bpe", character_coverage=1.0, byte_fallback=True, split_digits=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
            pad_id=-1, unk_id=0, bos_id=1, eos_id=2, num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
        os.replace(Path(tmp) / "tokenizer.model", model)  # atomic: concurrent builders are safe
    return model
