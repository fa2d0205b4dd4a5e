"""Train (once) the offline default tokenizer: sentencepiece BPE, 4096 pieces, on the embedded corpus.

Idempotent: returns at once when the model is already cached. Usage:
    python scripts/build_tokenizer.py [--out DIR] [--vocab-size N]
"""

import argparse
from pathlib import Path

from torchtitan_ext.data.default_tokenizer import VOCAB_SIZE, build
from torchtitan_ext.paths import default_tokenizer_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_tokenizer_dir())
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()
    print(f"tokenizer: {build(args.out, args.vocab_size)}")


if __name__ == "__main__":
    main()
