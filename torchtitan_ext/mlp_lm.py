"""torchtitan spec for the MLP-FFN LM of `models/mlp_lm.py`.

Flavors (the paper says only "0.6B"; these shapes are ours):

| flavor | dim | layers | heads | ffn | activation | vocab | params |
| --- | --- | --- | --- | --- | --- | --- | --- |
| debug | 256 | 4 | 4 | 1024 | relu | 4096 | 5.2M |
| 600m | 1280 | 26 | 20 | 5120 | relu | 32000 | 593M |
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torchtitan.protocols import BaseModel
from torchtitan.protocols.model_spec import ModelSpec

from models.mlp_lm import MLPLM, MLPLMConfig
from torchtitan_ext.preflight import check_seq_len
from torchtitan_ext.plain_model import (
    dense_nparams_and_flops,
    IdentityStateDictAdapter,
    parallelize_plain_decoder,
    PlainModelMixin,
)

FLAVORS = {
    "debug": MLPLMConfig(vocab_size=4096, dim=256, n_layers=4, n_heads=4, ffn_dim=1024),
    "600m": MLPLMConfig(vocab_size=32000, dim=1280, n_layers=26, n_heads=20, ffn_dim=5120),
}


class TorchtitanMLPLM(PlainModelMixin, BaseModel, MLPLM):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        model: MLPLMConfig = field(default_factory=MLPLMConfig)

        @property
        def vocab_size(self) -> int:
            return self.model.vocab_size

        @property
        def max_seq_len(self) -> int:
            return self.model.max_seq_len

        def update_from_config(self, *, config, **kwargs) -> None:
            check_seq_len(config)

        def get_nparams_and_flops(self, model, seq_len: int) -> tuple[int, int]:
            m = self.model
            return dense_nparams_and_flops(model, m.n_layers, m.n_heads, m.head_dim, seq_len, m.tie_embeddings)

    def __init__(self, config: Config):
        MLPLM.__init__(self, config.model)


def model_spec(flavor: str) -> ModelSpec:
    if flavor not in FLAVORS:
        raise ValueError(f"unknown MLP-FFN LM flavor '{flavor}': choose one of {sorted(FLAVORS)}")
    return ModelSpec(
        name="mlp_lm",
        flavor=flavor,
        model=TorchtitanMLPLM.Config(model=dataclasses.replace(FLAVORS[flavor])),  # a copy: callers may edit it
        parallelize_fn=parallelize_plain_decoder,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=IdentityStateDictAdapter,
    )
