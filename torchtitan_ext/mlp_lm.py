"""torchtitan spec for the MLP-FFN LM of `models/lms/mlp_lm.py`.

Flavors (the paper says only "0.6B"; these shapes are ours):

| flavor | dim | layers | heads | ffn | activation | vocab | params |
| --- | --- | --- | --- | --- | --- | --- | --- |
| debug | 256 | 4 | 4 | 1024 | relu | 4096 | 5.2M |
| 600m | 1280 | 26 | 20 | 5120 | relu | 32000 | 593M |
"""

from __future__ import annotations

from models.lms.mlp_lm import MLPLM, MLPLMConfig
from torchtitan_ext.families import Family
from torchtitan_ext import flops

FLAVORS = {
    "debug": dict(vocab_size=4096, dim=256, n_layers=4, n_heads=4, ffn_dim=1024),
    "600m": dict(vocab_size=32000, dim=1280, n_layers=26, n_heads=20, ffn_dim=5120),
}

FAMILY = Family(name="mlp_lm", summary="MLP-FFN LM: Transformer with a plain 2-layer MLP FFN (Locas' from-scratch base)",
                flavors=FLAVORS, config_class=MLPLMConfig, plain_class=MLPLM, flops_per_token=flops.mlp_lm)
model_config, model_spec = FAMILY.config, FAMILY.model_spec
