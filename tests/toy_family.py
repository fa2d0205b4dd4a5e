"""A toy model family as a newcomer would add one, kept outside the packages: the model
(tests/toy_model.py, what `models/<family>.py` holds), a config function (what
`train_configs/<family>.py` holds) and the registry entry (`TOY`, what
`torchtitan_ext/families/<family>.py` holds). tests/test_families.py registers it and checks that the
catalogue, parameter counts, FLOPs, export and evaluation take it with no other edit."""

from __future__ import annotations

from torchtitan.trainer import Trainer

from toy_model import ToyConfig, ToyLM
from torchtitan_ext.families import Family
from train_configs.recipe import debug_recipe


TOY = Family(name="toy", summary="a toy decoder (tests)", flavors={"debug": {}}, config_class=ToyConfig,
             plain_class=ToyLM, config_module="toy_family")


def toy_debug() -> Trainer.Config:
    """The toy decoder at debug size."""
    return debug_recipe(TOY.model_spec("debug"), name="toy_debug")
