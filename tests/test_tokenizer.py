"""The tokenizer component: sentencepiece .model and HF tokenizer.json through one class."""

from __future__ import annotations

import json

import pytest
from tokenizers import models, pre_tokenizers, trainers, Tokenizer

from torchtitan_ext.errors import UserError
from torchtitan_ext.data.tokenizer import AssetsTokenizer

TEXT = "Memory is learned and written at test time."


LOSSLESS = ["def f(x):\n    return x**2\n", "two  spaces,\ttab\r\n", "Ünïcödé 東京 🙂 2026"]


def test_sentencepiece_default_round_trips_with_bos_eos(tokenizer_dir):
    tok = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(tokenizer_dir))
    ids = tok.encode(TEXT, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.bos_id != tok.eos_id
    assert tok.decode(ids[1:-1]) == TEXT
    assert tok.get_vocab_size() == 4096
    for text in LOSSLESS:  # newlines, indentation, repeated spaces, unicode and digits survive
        assert tok.decode(tok.encode(text, add_bos=False, add_eos=False)) == text


def test_hf_tokenizer_json_is_accepted(tmp_path):
    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"]))
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(tmp_path))
    ids = tok.encode(TEXT, add_bos=True, add_eos=True)
    assert ids[0] == hf.token_to_id("<s>") and ids[-1] == hf.token_to_id("</s>") == tok.eos_id
    assert tok.get_vocab_size() == hf.get_vocab_size()


def test_folder_without_tokenizer_files_names_the_fix(tmp_path):
    with pytest.raises(UserError, match="build_tokenizer.py"):
        AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(tmp_path))
