"""Transformer++ (torchtitan's llama3) configs: `--module train_configs.transformer`."""

from torchtitan.trainer import Trainer

from torchtitan_ext.families.transformer import model_spec
from train_configs.recipe import debug_recipe, paper_recipe


def transformer_debug() -> Trainer.Config:
    """5.2M parameters, embedded corpus, CPU, a few minutes."""
    return debug_recipe(model_spec("debug"), name="transformer_debug")


def transformer_small() -> Trainer.Config:
    """2.4M parameters (the size of mela_debug), embedded corpus, CPU."""
    return debug_recipe(model_spec("small"), name="transformer_small")


def transformer_400m() -> Trainer.Config:
    return paper_recipe(model_spec("400m"), name="transformer_400m", lr=1e-3)


def transformer_800m() -> Trainer.Config:
    return paper_recipe(model_spec("800m"), name="transformer_800m", lr=1e-3)


def transformer_1b2() -> Trainer.Config:
    return paper_recipe(model_spec("1b2"), name="transformer_1b2", lr=8e-4)


def transformer_mela_400m_peer() -> Trainer.Config:
    """Transformer++ with Mela 400m's parameter count (358.7M vs 356.5M), same recipe."""
    return paper_recipe(model_spec("mela_400m_peer"), name="transformer_mela_400m_peer", lr=1e-3)


def transformer_mela_800m_peer() -> Trainer.Config:
    """Transformer++ with Mela 800m's parameter count (682.3M vs 681.8M), same recipe."""
    return paper_recipe(model_spec("mela_800m_peer"), name="transformer_mela_800m_peer", lr=1e-3)


def transformer_mela_1b2_peer() -> Trainer.Config:
    """Transformer++ with Mela 1b2's parameter count (1037.1M vs 1029.0M), same recipe."""
    return paper_recipe(model_spec("mela_1b2_peer"), name="transformer_mela_1b2_peer", lr=8e-4)
