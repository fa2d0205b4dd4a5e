"""Titans configs (MAC / MAG / MAL / LMM): `--module train_configs.titans`.

`titans_<variant>_debug` trains in minutes on CPU; `titans_<variant>_{170m,400m,760m}` use
the Mela paper's recipe (the Titans section gives no other), FineWeb-Edu, 4K context.
"""

from torchtitan.trainer import Trainer

from torchtitan_ext.families.titans import model_spec
from train_configs.recipe import debug_recipe, paper_recipe


def _debug(variant: str) -> Trainer.Config:
    config = debug_recipe(model_spec("debug", variant=variant), name=f"titans_{variant}_debug")
    # Selective AC recomputes the memory's inner loop: 2.5x slower on CPU, and the debug
    # model needs no memory saving (`activation-checkpoint:selective` turns it back on).
    config.activation_checkpoint = None
    return config


def _paper(variant: str, flavor: str) -> Trainer.Config:
    """Local batch 2 (the global batch stays the recipe's 128 x 4K: gradient accumulation):
    `scripts/memory_budget.py` predicts 15 GiB (400m) and 19 GiB (760m) of activations per 4K
    sequence for MAC under selective AC, so the recipe's default 8 would need 125 GiB per
    rank at 400m; 2 keeps 760m at 39 GiB (FSDP over 8 ranks), within an 80 GiB GPU."""
    return paper_recipe(model_spec(flavor, variant=variant), name=f"titans_{variant}_{flavor}", lr=1e-3,
                        local_batch_size=2)


def titans_mac_debug() -> Trainer.Config:
    """Memory as context, 1.9M parameters, CPU."""
    return _debug("mac")


def titans_mag_debug() -> Trainer.Config:
    """Memory as gate, 1.9M parameters, CPU."""
    return _debug("mag")


def titans_mal_debug() -> Trainer.Config:
    """Memory as layer, 1.8M parameters, CPU."""
    return _debug("mal")


def titans_lmm_debug() -> Trainer.Config:
    """Memory-only blocks, 1.7M parameters, CPU."""
    return _debug("lmm")


def titans_mac_170m() -> Trainer.Config:
    return _paper("mac", "170m")

def titans_mac_400m() -> Trainer.Config:
    return _paper("mac", "400m")

def titans_mac_760m() -> Trainer.Config:
    return _paper("mac", "760m")

def titans_mag_170m() -> Trainer.Config:
    return _paper("mag", "170m")

def titans_mag_400m() -> Trainer.Config:
    return _paper("mag", "400m")

def titans_mag_760m() -> Trainer.Config:
    return _paper("mag", "760m")

def titans_mal_170m() -> Trainer.Config:
    return _paper("mal", "170m")

def titans_mal_400m() -> Trainer.Config:
    return _paper("mal", "400m")

def titans_mal_760m() -> Trainer.Config:
    return _paper("mal", "760m")

def titans_lmm_170m() -> Trainer.Config:
    return _paper("lmm", "170m")

def titans_lmm_400m() -> Trainer.Config:
    return _paper("lmm", "400m")

def titans_lmm_760m() -> Trainer.Config:
    return _paper("lmm", "760m")
