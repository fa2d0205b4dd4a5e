"""The character-level tokenizer of GradMem's KV-retrieval (the public code's 62-symbol
alphabet): 70 tokens, `<pad>` 0, `<s>` 1 (BOS), `</s>` 2 (EOS), `<unk>` 3, then a-z, A-Z, 0-9
and `! ? : |`, one token per character. Written as a Hugging Face `tokenizer.json` with its
`tokenizer_config.json`, which torchtitan's tokenizer (and `transformers`) read; `build()` is
idempotent and atomic, and the GradMem configs' preflight runs it (`--hf_assets_path` default).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from torchtitan_ext.paths import cache_dir
from torchtitan_ext.data.synthetic_tasks import SYMBOLS

SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")
ALPHABET = SYMBOLS + "!?:|"
VOCAB_SIZE = len(SPECIAL) + len(ALPHABET)  # 70


def kv_tokenizer_dir() -> Path:
    return cache_dir() / "tokenizer" / "kv-char70"


def build(out: Path | None = None) -> Path:
    """The folder holding the tokenizer (default `kv_tokenizer_dir()`), written if absent."""
    from tokenizers import decoders, models, pre_tokenizers, Regex, Tokenizer

    out = Path(out or kv_tokenizer_dir())
    if (out / "tokenizer.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + tuple(ALPHABET))}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True, "add_eos_token": False}
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        tokenizer.save(str(Path(tmp) / "tokenizer.json"))
        os.replace(Path(tmp) / "tokenizer_config.json", out / "tokenizer_config.json")
        os.replace(Path(tmp) / "tokenizer.json", out / "tokenizer.json")  # last: its presence means built
    return out
