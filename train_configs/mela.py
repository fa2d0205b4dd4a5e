"""Mela configs: `--module train_configs.mela`.

`mela_debug` trains in minutes on CPU; `mela_{400m,800m,1b2}` are Table 1 of the paper with
the section 5.1 recipe (FineWeb-Edu, 4K context, AdamW 0.9/0.95, peak lr 1e-3 / 1e-3 / 8e-4,
cosine to 10%, 500 warmup steps, weight decay 0.1, clip 1.0, 0.5M-token batches, FSDP2).
The Table 4 ablations are `MelaConfig` fields (newton_schulz_steps, memstack,
attention_gating, fusion, memory_attention, neural_memory, h_cycles, l_cycles, h_layers,
l_layers): `mela_400m_<ablation>` has each Table 4 row; for others (cycles, depths) call
`torchtitan_ext.mela.model_spec("400m", **fields)` from a config module of your own.
"""

from torchtitan.trainer import Trainer

from torchtitan_ext.mela import model_spec
from train_configs.recipe import debug_recipe, paper_recipe


def mela_debug() -> Trainer.Config:
    """2.4M parameters (HMM H=L=2, P=C=8), embedded corpus, CPU, a few minutes."""
    config = debug_recipe(model_spec("debug"), name="mela_debug")
    # As for Titans: selective AC recomputes the memories' inner loops (slower on CPU) and the
    # debug model needs no memory saving; `--activation-checkpoint:selective` turns it on.
    config.activation_checkpoint = None
    return config


def mela_400m() -> Trainer.Config:
    """Table 1 Mela-400M (357M parameters, 27.6% memory / 65.5% language)."""
    return paper_recipe(model_spec("400m"), name="mela_400m", lr=1e-3)


def mela_800m() -> Trainer.Config:
    """Table 1 Mela-800M (682M parameters, 28.7% memory / 66.5% language)."""
    return paper_recipe(model_spec("800m"), name="mela_800m", lr=1e-3)


def mela_1b2() -> Trainer.Config:
    """Table 1 Mela-1.2B (1029M parameters, 18.2% memory / 77.1% language)."""
    return paper_recipe(model_spec("1b2"), name="mela_1b2", lr=8e-4)


def _ablation(**fields) -> Trainer.Config:
    suffix = "_".join(f"{k}-{v}" for k, v in sorted(fields.items()))
    return paper_recipe(model_spec("400m", **fields), name=f"mela_400m_{suffix}", lr=1e-3)


def mela_400m_no_newton_schulz() -> Trainer.Config:
    """Table 4 ablation: momentum update without Newton-Schulz."""
    return _ablation(newton_schulz_steps=0)


def mela_400m_no_memstack() -> Trainer.Config:
    """Table 4 ablation: memory tokens only at the input, no MemStack."""
    return _ablation(memstack=False)


def mela_400m_no_gating() -> Trainer.Config:
    """Table 4 ablation: plain (ungated) attention in the memory blocks."""
    return _ablation(attention_gating=False)


def mela_400m_fusion_h_only() -> Trainer.Config:
    """Table 4 ablation: the h state alone as memory output (fusion "None")."""
    return _ablation(fusion="h_only")


def mela_400m_fusion_weighted_sum() -> Trainer.Config:
    """Table 4 ablation: a learned weighted sum of l and h instead of the fusion MLP."""
    return _ablation(fusion="weighted_sum")


def mela_400m_no_memory_attention() -> Trainer.Config:
    """Table 4 ablation: memory blocks without attention."""
    return _ablation(memory_attention=False)


def mela_400m_no_neural_memory() -> Trainer.Config:
    """Table 4 ablation: memory blocks without the neural memory."""
    return _ablation(neural_memory=False)
