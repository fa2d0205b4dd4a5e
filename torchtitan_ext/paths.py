"""Where the project keeps generated files (tokenizers, caches). Override with MNLM_CACHE."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    return Path(os.environ.get("MNLM_CACHE", REPO_ROOT / ".cache"))


def default_tokenizer_dir() -> Path:
    """The sentencepiece model trained on the embedded corpus (scripts/build_tokenizer.py)."""
    return cache_dir() / "tokenizer" / "embedded-sp4096"
