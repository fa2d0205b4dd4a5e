"""Train (once) the offline default tokenizer: sentencepiece BPE, 4096 pieces, on the embedded corpus.

Idempotent: returns at once when the model is already cached. Usage:
    python scripts/build_tokenizer.py [--out DIR] [--vocab-size N]
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan_ext.embedded_corpus import embedded_documents  # noqa: E402
from torchtitan_ext.paths import default_tokenizer_dir  # noqa: E402


def build(out: Path, vocab_size: int) -> Path:
    import sentencepiece as spm

    model = out / "tokenizer.model"
    if model.is_file():
        return model
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(embedded_documents()), encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(Path(tmp) / "tokenizer"), vocab_size=vocab_size,
            model_type="bpe", character_coverage=1.0, byte_fallback=True,
            pad_id=-1, unk_id=0, bos_id=1, eos_id=2, num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
        os.replace(Path(tmp) / "tokenizer.model", model)  # atomic: concurrent builders are safe
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_tokenizer_dir())
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()
    print(f"tokenizer: {build(args.out, args.vocab_size)}")


if __name__ == "__main__":
    main()
