"""Configs broken on purpose, for the tests of clear errors."""

from train_configs.mela import mela_debug


def mela_missing_tokenizer():
    config = mela_debug()
    config.hf_assets_path = "/nonexistent/tokenizer"
    return config
