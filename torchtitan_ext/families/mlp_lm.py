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

def flops_per_token(cfg: MLPLMConfig, seq_len: int) -> float:
    """Per token: GQA attention projections and span, two-layer FFN, output head."""
    d, kv = cfg.dim, (cfg.n_kv_heads or cfg.n_heads) * cfg.head_dim
    block = 2 * flops.linear(d, d) + 2 * flops.linear(d, kv) + flops.attention_span(d, seq_len) + 2 * flops.linear(d, cfg.ffn_dim)
    return flops.TRAIN * (cfg.n_layers * block + flops.linear(d, cfg.vocab_size))


FAMILY = Family(name="mlp_lm", summary="MLP-FFN LM: Transformer with a plain 2-layer MLP FFN (Locas' from-scratch base)",
                flavors=FLAVORS, config_class=MLPLMConfig, plain_class=MLPLM, flops_per_token=flops_per_token)
model_config, model_spec = FAMILY.config, FAMILY.model_spec
