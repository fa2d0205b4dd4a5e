"""Configs only the leaderboard (`python scripts/leaderboard.py`) trains: Mela's memory-off twin
at debug and paper size (the same decoder and window, `memory_path=False`: every decoder chunk
reads `memory_init`), the cpu suite's from-scratch rows at equal non-embedding parameters and
its graft rows at equal trainable parameters."""

import dataclasses

from torchtitan.trainer import Trainer

from torchtitan_ext.families.mela import model_spec
from torchtitan_ext.families.mlp_lm import model_spec as mlp_lm_spec
from torchtitan_ext.families.titans import model_spec as titans_spec
from torchtitan_ext.families.transformer import model_spec as transformer_spec
from train_configs.backbone import LORA_PARAMETERS, memoryllama_debug, mone_qwen3_debug, pretrain_mix, qwen3_debug_lora
from train_configs.mela import mela_400m, mela_debug
from train_configs.recipe import debug_recipe, grouped_adamw
from train_configs.titans import titans_mac_debug


def _memory_off(config: Trainer.Config, flavor: str, name: str) -> Trainer.Config:
    config.model_spec = model_spec(flavor, memory_path=False)
    config.dump_folder = f"./outputs/{name}"
    return config


def mela_debug_memory_off() -> Trainer.Config:
    """mela_debug with its memory path off (2.4M parameters, the HMM unused)."""
    return _memory_off(mela_debug(), "debug", "mela_debug_memory_off")


def mela_400m_memory_off() -> Trainer.Config:
    """mela_400m with its memory path off (the paper recipe, FineWeb-Edu, 5B tokens)."""
    return _memory_off(mela_400m(), "400m", "mela_400m_memory_off")


# The cpu suite's from-scratch rows at equal non-embedding parameters (Mela debug's 1.92M,
# within 5%: tests/test_leaderboard.py): more, narrower layers where a family's debug shape is
# larger or smaller; the recipe is each family's debug one.
def transformer_cpu() -> Trainer.Config:
    """Transformer++ at dim 128, 10 layers (1.97M non-embedding parameters)."""
    return debug_recipe(transformer_spec("leaderboard_cpu"), name="transformer_cpu")


def _titans_cpu(variant: str, n_layers: int) -> Trainer.Config:
    config = debug_recipe(titans_spec("debug", variant=variant, n_layers=n_layers), name=f"titans_{variant}_cpu")
    config.activation_checkpoint = None  # as titans_<variant>_debug
    return config


def titans_mac_cpu() -> Trainer.Config:
    """Titans MAC, 5 layers of the debug width (1.99M non-embedding parameters)."""
    return _titans_cpu("mac", 5)


def _mac_inputs(config: Trainer.Config, name: str) -> Trainer.Config:
    """`config` (a Titans MAC config) with MAC's memory writing and reading the segment's normed
    inputs instead of the attention outputs (`TitansConfig.mac_write`, the MQAR suite's H9
    ablation): its model otherwise as it was, the same parameters and recipe."""
    spec = config.model_spec
    model = dataclasses.replace(spec.model, model=dataclasses.replace(spec.model.model, mac_write="inputs"))
    config.model_spec = dataclasses.replace(spec, model=model)
    config.dump_folder = f"./outputs/{name}"
    return config


def titans_mac_inputs_debug() -> Trainer.Config:
    """titans_mac_debug writing its segment's inputs (the ci suite's row)."""
    return _mac_inputs(titans_mac_debug(), "titans_mac_inputs_debug")


def titans_mac_inputs_cpu() -> Trainer.Config:
    """titans_mac_cpu writing its segment's inputs (the cpu suite's row; issue 48: does the
    recall winner pay for it in perplexity?)."""
    return _mac_inputs(titans_mac_cpu(), "titans_mac_inputs_cpu")


def titans_mag_cpu() -> Trainer.Config:
    """Titans MAG, 5 layers of the debug width."""
    return _titans_cpu("mag", 5)


def titans_mal_cpu() -> Trainer.Config:
    """Titans MAL, 5 layers of the debug width."""
    return _titans_cpu("mal", 5)


def titans_lmm_cpu() -> Trainer.Config:
    """Titans LMM, 6 layers of the debug width."""
    return _titans_cpu("lmm", 6)


def mlp_lm_cpu() -> Trainer.Config:
    """MLP-FFN LM at dim 128, FFN 512, 10 layers."""
    return debug_recipe(mlp_lm_spec("debug", dim=128, ffn_dim=512, n_layers=10), name="mlp_lm_cpu")


# The cpu suite's graft rows at equal trainable parameters (within 5%: tests/test_leaderboard.py):
# grafted GradMem's 615,424 (its WRITE head, which has no rank to trim, is most of it; its
# forward twin matches it in train_configs/gradmem.py), the others' LoRA rank raised to meet it,
# alpha / rank kept. LoRA on every block of qwen3_debug holds 11,264 parameters per unit of
# rank, MoNe's (W_q, W_k, W_v) 3,584.
EQUAL_TRAINABLE_RANKS = {"lora_only": 55, "memoryllama": 22, "mone": 115}
# Their data and learning rates (`on_backbone_mix`; docs/leaderboard.md "Second graft run"):
# the first cpu run fine-tuned each graft on embedded-corpus prose alone with its debug config's
# rates (LoRA at 1e-2 for LoRA-only and MemoryLlama), which cost every graft, the LoRA-only
# control too, the backbone's in-window S-NIAH (0.995 -> 0 inside the window) and raised its
# held-out perplexity (LoRA-only 289 -> 370). Now every graft continues on the backbone's own
# pretraining mix (other draws: seed 1), inside the backbone's window as the backbone was
# trained (no recall length beyond it), with one rate for every row's LoRA (mone_debug's 5e-4)
# and one for every memory (1e-2, the debug configs' memory rate): what a graft adds over
# LoRA-only is then its memory alone.
# Batches of 8 sequences of 256: 60 steps are 122,880 tokens, the from-scratch rows' count.
GRAFT_DATA_SEED = 1
GRAFT_LORA_LR = 5e-4
GRAFT_MEMORY_LR = 1e-2
GRAFT_BATCH = 8


def on_backbone_mix(config: Trainer.Config) -> Trainer.Config:
    """`config` trained on the backbone's pretraining mix (pretrain_mix, seed GRAFT_DATA_SEED) in
    batches of GRAFT_BATCH, LoRA at GRAFT_LORA_LR, every other trainable parameter (a memory) at
    GRAFT_MEMORY_LR."""
    config.dataloader = pretrain_mix(GRAFT_DATA_SEED)
    config.training = dataclasses.replace(config.training, local_batch_size=GRAFT_BATCH)
    groups = [(LORA_PARAMETERS, GRAFT_LORA_LR)]
    if config.model_spec.model.model.graft.kind != "lora":  # LoRA-only trains nothing else
        groups.append((".*", GRAFT_MEMORY_LR))
    config.optimizer = grouped_adamw(groups)
    return config


def lora_only_cpu() -> Trainer.Config:
    """The LoRA-only control, rank 55 on every block (619,520 trainable parameters)."""
    return on_backbone_mix(qwen3_debug_lora(EQUAL_TRAINABLE_RANKS["lora_only"], "lora_only_cpu"))


def memoryllama_alma_cpu() -> Trainer.Config:
    """MemoryLlama ALMA, LoRA rank 22 (609,798 trainable parameters)."""
    return on_backbone_mix(memoryllama_debug("alma", EQUAL_TRAINABLE_RANKS["memoryllama"], "memoryllama_alma_cpu"))


def memoryllama_gema_cpu() -> Trainer.Config:
    """MemoryLlama GeMA, LoRA rank 22 (609,798 trainable parameters)."""
    return on_backbone_mix(memoryllama_debug("gema", EQUAL_TRAINABLE_RANKS["memoryllama"], "memoryllama_gema_cpu"))


def mone_cpu() -> Trainer.Config:
    """MoNe, LoRA rank 115 on W_q, W_k, W_v (617,120 trainable parameters)."""
    return on_backbone_mix(mone_qwen3_debug(EQUAL_TRAINABLE_RANKS["mone"], "mone_cpu"))
