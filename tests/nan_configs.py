"""A config that diverges on purpose (test of the non-finite-loss stop)."""

from torchtitan.components.optimizer import default_adamw

from train_configs.transformer import transformer_debug


def transformer_diverging():
    config = transformer_debug()
    config.optimizer = default_adamw(lr=1e6)
    config.training.max_norm = 1e12
    return config
