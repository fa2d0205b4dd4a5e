"""A paper recipe scaled down for CPU (tests/test_training.py): `paper_recipe` itself, with
the debug Mela model; the test passes the smaller batch, context and data on the command line."""

from torchtitan.trainer import Trainer

from torchtitan_ext.families.mela import model_spec
from train_configs.recipe import paper_recipe


def mela_debug_paper_recipe() -> Trainer.Config:
    """mela_debug under the section 5.1 recipe (local batch ceiling 8, global batch fixed)."""
    return paper_recipe(model_spec("debug"), name="mela_debug_paper_recipe")
