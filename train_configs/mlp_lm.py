"""MLP-FFN LM (Locas' from-scratch decoder) configs: `--module train_configs.mlp_lm`."""

from torchtitan.trainer import Trainer

from torchtitan_ext.families.mlp_lm import model_spec
from train_configs.recipe import debug_recipe, paper_recipe


def mlp_lm_debug() -> Trainer.Config:
    """5.2M parameters, embedded corpus, CPU, a few minutes."""
    return debug_recipe(model_spec("debug"), name="mlp_lm_debug")


def mlp_lm_600m() -> Trainer.Config:
    """0.59B parameters at the Mela recipe (the Locas paper trains on 150B SlimPajama tokens;
    pass --dataloader.dataset local --dataloader.dataset_path <SlimPajama parquet> to follow it)."""
    return paper_recipe(model_spec("600m"), name="mlp_lm_600m", lr=1e-3)
