"""Configs broken on purpose, for the tests of clear errors."""

import dataclasses

from train_configs.backbone import mone_debug
from train_configs.mela import mela_debug


def mela_missing_tokenizer():
    config = mela_debug()
    config.hf_assets_path = "/nonexistent/tokenizer"
    return config


def mone_heads_not_dividing():
    """MoNe with 3 heads on the debug Qwen3 (query width 256, dim 128)."""
    config = mone_debug()
    graft = config.model_spec.model.model.graft
    graft.memory = dataclasses.replace(graft.memory, heads=3)
    return config
