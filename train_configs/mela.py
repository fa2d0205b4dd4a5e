"""Mela configs: `--module train_configs.mela`.

`mela_debug` trains in minutes on CPU; `mela_{400m,800m,1b2}` are Table 1 of the paper with
the section 5.1 recipe (FineWeb-Edu, 4K context, AdamW 0.9/0.95, peak lr 1e-3 / 1e-3 / 8e-4,
cosine to 10%, 500 warmup steps, weight decay 0.1, clip 1.0, 0.5M-token batches, FSDP2).
Section 5.3's ablations (Tables 2, 3 and 4) are `MelaConfig` fields: `mela_400m_<row>` has
each row of the three tables on the paper's 1B-token budget (`ABLATIONS` lists them; `bash
scripts/train.sh --list` prints them), `mela_400m_ablation_base` the full model on the same
budget. Other combinations: `torchtitan_ext.families.mela.model_spec("400m", **fields)` from a config
module of your own.
"""

from torchtitan.trainer import Trainer

from torchtitan_ext.families.mela import model_spec
from train_configs.recipe import ABLATION_TRAIN_TOKENS, debug_recipe, paper_recipe


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


# Section 5.3 (the 400m model, 1B tokens each). Table 2 sweeps H and L cycles over {1, 2, 4}
# (the other at 4), Table 3 the H- and L-module depths over {2, 8} blocks, Table 4 removes
# one component per row. `ablation_base` is the full model at the same budget.
ABLATIONS = {
    "ablation_base": ({}, "Section 5.3 reference"),
    **{f"h_cycles_{n}": (dict(h_cycles=n), "Table 2: H cycles") for n in (1, 2, 4)},
    **{f"l_cycles_{n}": (dict(l_cycles=n), "Table 2: L cycles") for n in (1, 2, 4)},
    **{f"h_layers_{n}": (dict(h_layers=n), "Table 3: H-module memory blocks") for n in (2, 8)},
    **{f"l_layers_{n}": (dict(l_layers=n), "Table 3: L-module memory blocks") for n in (2, 8)},
    "no_newton_schulz": (dict(newton_schulz_steps=0, memory_step_scale=1.0),
                         "Table 4: momentum update without Newton-Schulz (M = alpha M + S, eq. 4-5: theta is its step)"),
    "no_memstack": (dict(memstack=False), "Table 4: memory tokens only at the input, no MemStack"),
    "no_gating": (dict(attention_gating=False), "Table 4: plain (ungated) attention in the memory blocks"),
    "fusion_h_only": (dict(fusion="h_only"), 'Table 4: the h state alone as memory output (fusion "None")'),
    "fusion_weighted_sum": (dict(fusion="weighted_sum"), "Table 4: a learned weighted sum of l and h"),
    "no_memory_attention": (dict(memory_attention=False), "Table 4: memory blocks without attention"),
    "no_neural_memory": (dict(neural_memory=False), "Table 4: memory blocks without the neural memory"),
    "per_step_chain": (dict(memory_chain="per_step"), "One memory chain per module step of the recursion"),
    "unit_step": (dict(memory_step_scale=1.0), "Eq. 10 as printed: no step size after Newton-Schulz"),
}


def _ablation(name: str) -> Trainer.Config:
    """The 400m model with `ABLATIONS[name]`'s fields on section 5.3's 1B-token budget."""
    fields, _ = ABLATIONS[name]
    return paper_recipe(model_spec("400m", **fields), name=f"mela_400m_{name}", lr=1e-3,
                        train_tokens=ABLATION_TRAIN_TOKENS)


def mela_400m_ablation_base() -> Trainer.Config:
    """Section 5.3 reference: the full model (1B tokens; `ABLATIONS["ablation_base"]`)."""
    return _ablation("ablation_base")


def mela_400m_h_cycles_1() -> Trainer.Config:
    """Table 2: 1 H cycle (1B tokens; `ABLATIONS["h_cycles_1"]`)."""
    return _ablation("h_cycles_1")


def mela_400m_h_cycles_2() -> Trainer.Config:
    """Table 2: 2 H cycles (1B tokens; `ABLATIONS["h_cycles_2"]`)."""
    return _ablation("h_cycles_2")


def mela_400m_h_cycles_4() -> Trainer.Config:
    """Table 2: 4 H cycles (1B tokens; `ABLATIONS["h_cycles_4"]`)."""
    return _ablation("h_cycles_4")


def mela_400m_l_cycles_1() -> Trainer.Config:
    """Table 2: 1 L cycle (1B tokens; `ABLATIONS["l_cycles_1"]`)."""
    return _ablation("l_cycles_1")


def mela_400m_l_cycles_2() -> Trainer.Config:
    """Table 2: 2 L cycles (1B tokens; `ABLATIONS["l_cycles_2"]`)."""
    return _ablation("l_cycles_2")


def mela_400m_l_cycles_4() -> Trainer.Config:
    """Table 2: 4 L cycles (1B tokens; `ABLATIONS["l_cycles_4"]`)."""
    return _ablation("l_cycles_4")


def mela_400m_h_layers_2() -> Trainer.Config:
    """Table 3: 2 H-module memory blocks (1B tokens; `ABLATIONS["h_layers_2"]`)."""
    return _ablation("h_layers_2")


def mela_400m_h_layers_8() -> Trainer.Config:
    """Table 3: 8 H-module memory blocks (1B tokens; `ABLATIONS["h_layers_8"]`)."""
    return _ablation("h_layers_8")


def mela_400m_l_layers_2() -> Trainer.Config:
    """Table 3: 2 L-module memory blocks (1B tokens; `ABLATIONS["l_layers_2"]`)."""
    return _ablation("l_layers_2")


def mela_400m_l_layers_8() -> Trainer.Config:
    """Table 3: 8 L-module memory blocks (1B tokens; `ABLATIONS["l_layers_8"]`)."""
    return _ablation("l_layers_8")


def mela_400m_no_newton_schulz() -> Trainer.Config:
    """Table 4: momentum update without Newton-Schulz (1B tokens; `ABLATIONS["no_newton_schulz"]`)."""
    return _ablation("no_newton_schulz")


def mela_400m_no_memstack() -> Trainer.Config:
    """Table 4: memory tokens only at the input, no MemStack (1B tokens; `ABLATIONS["no_memstack"]`)."""
    return _ablation("no_memstack")


def mela_400m_no_gating() -> Trainer.Config:
    """Table 4: plain (ungated) attention in the memory blocks (1B tokens; `ABLATIONS["no_gating"]`)."""
    return _ablation("no_gating")


def mela_400m_fusion_h_only() -> Trainer.Config:
    """Table 4: the h state alone as memory output (1B tokens; `ABLATIONS["fusion_h_only"]`)."""
    return _ablation("fusion_h_only")


def mela_400m_fusion_weighted_sum() -> Trainer.Config:
    """Table 4: a learned weighted sum of l and h (1B tokens; `ABLATIONS["fusion_weighted_sum"]`)."""
    return _ablation("fusion_weighted_sum")


def mela_400m_no_memory_attention() -> Trainer.Config:
    """Table 4: memory blocks without attention (1B tokens; `ABLATIONS["no_memory_attention"]`)."""
    return _ablation("no_memory_attention")


def mela_400m_no_neural_memory() -> Trainer.Config:
    """Table 4: memory blocks without the neural memory (1B tokens; `ABLATIONS["no_neural_memory"]`)."""
    return _ablation("no_neural_memory")


def mela_400m_per_step_chain() -> Trainer.Config:
    """One memory chain per module step of the recursion (1B tokens; `ABLATIONS["per_step_chain"]`)."""
    return _ablation("per_step_chain")


def mela_400m_unit_step() -> Trainer.Config:
    """Eq. 10 as printed: no step size after Newton-Schulz (1B tokens; `ABLATIONS["unit_step"]`)."""
    return _ablation("unit_step")
