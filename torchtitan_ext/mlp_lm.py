"""torchtitan spec for the MLP-FFN LM of `models/mlp_lm.py`.

Flavors (the paper says only "0.6B"; these shapes are ours):

| flavor | dim | layers | heads | ffn | activation | vocab | params |
| --- | --- | --- | --- | --- | --- | --- | --- |
| debug | 256 | 4 | 4 | 1024 | relu | 4096 | 5.2M |
| 600m | 1280 | 26 | 20 | 5120 | relu | 32000 | 593M |
"""

from __future__ import annotations

from torchtitan.protocols.model_spec import ModelSpec

from models.mlp_lm import MLPLM, MLPLMConfig
from torchtitan_ext.plain_model import plain_model_spec, torchtitan_model

FLAVORS = {
    "debug": MLPLMConfig(vocab_size=4096, dim=256, n_layers=4, n_heads=4, ffn_dim=1024),
    "600m": MLPLMConfig(vocab_size=32000, dim=1280, n_layers=26, n_heads=20, ffn_dim=5120),
}

TorchtitanMLPLM = torchtitan_model(MLPLM, MLPLMConfig)


def model_spec(flavor: str) -> ModelSpec:
    if flavor not in FLAVORS:
        raise ValueError(f"unknown MLP-FFN LM flavor '{flavor}': choose one of {sorted(FLAVORS)}")
    return plain_model_spec("mlp_lm", flavor, TorchtitanMLPLM, FLAVORS[flavor])
