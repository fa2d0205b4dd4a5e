"""One torchtitan tokenizer class for a sentencepiece `tokenizer.model` or a HF `tokenizer.json`.

`hf_assets_path` names a folder. If it holds `tokenizer.model` (e.g. the Llama-2 32K
tokenizer the user supplies, or the offline default trained by
`scripts/build_tokenizer.py`) sentencepiece reads it; otherwise torchtitan's own
`HuggingFaceTokenizer` reads `tokenizer.json` (+ `tokenizer_config.json`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer

from torchtitan_ext.errors import UserError


def tokenizer_kind(folder: str | Path) -> str:
    """"sentencepiece" or "hf", or a UserError naming the missing files and the fix."""
    folder = Path(folder)
    if (folder / "tokenizer.model").is_file():
        return "sentencepiece"
    if (folder / "tokenizer.json").is_file():
        return "hf"
    raise UserError(
        f"no tokenizer.model or tokenizer.json in '{folder}': pass --hf_assets_path "
        "<folder with one>, or run `python scripts/build_tokenizer.py` for the offline default"
    )


class SentencePieceTokenizer(BaseTokenizer):
    """sentencepiece model with BOS/EOS ids taken from the model itself."""

    def __init__(self, model_file: str | Path):
        super().__init__()
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_file=str(model_file))
        self.bos_id = self._sp.bos_id()
        self.eos_id = self._sp.eos_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise UserError(f"sentencepiece model '{model_file}' has no BOS/EOS ids; retrain it with bos_id/eos_id set")

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = self._sp.encode(text)
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def decode(self, ids: list[int], **kwargs) -> str:
        return self._sp.decode(list(ids))

    def get_vocab_size(self) -> int:
        return self._sp.get_piece_size()


class AssetsTokenizer(BaseTokenizer):
    """torchtitan tokenizer component: picks sentencepiece or HF by the files present."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, *, tokenizer_path: str):
        super().__init__()
        if tokenizer_kind(tokenizer_path) == "sentencepiece":
            self._impl = SentencePieceTokenizer(Path(tokenizer_path) / "tokenizer.model")
        else:
            self._impl = HuggingFaceTokenizer(HuggingFaceTokenizer.Config(), tokenizer_path=tokenizer_path)
        self.bos_id = getattr(self._impl, "bos_id", None)
        self.eos_id = self._impl.eos_id

    def encode(self, *args, **kwargs) -> list[int]:
        return self._impl.encode(*args, **kwargs)

    def decode(self, *args, **kwargs) -> str:
        return self._impl.decode(*args, **kwargs)

    def get_vocab_size(self) -> int:
        return self._impl.get_vocab_size()
