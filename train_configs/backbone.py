"""Pretrained-backbone configs (Llama / Qwen3 in plain torch): `--module train_configs.backbone`.

The debug ones train the backbone from scratch on the embedded corpus (CPU, minutes): the
torchtitan path (FSDP2, AC, compile, DCP, export as a transformers Llama / Qwen3) that the
grafted finetunes build on.
"""

from torchtitan.trainer import Trainer

from models.grafts.graft import GraftConfig
from models.grafts.lora import LoRAConfig
from torchtitan_ext.backbone import FAMILY
from train_configs.recipe import debug_recipe


def backbone_llama_debug() -> Trainer.Config:
    """A 4-layer Llama (GQA, Llama 3 RoPE scaling), embedded corpus, CPU."""
    return debug_recipe(FAMILY.model_spec("llama_debug"), name="backbone_llama_debug")


def backbone_qwen3_debug() -> Trainer.Config:
    """A 4-layer Qwen3 (q/k norm, head_dim 64 with dim 128 / 4 heads, tied), embedded corpus, CPU."""
    return debug_recipe(FAMILY.model_spec("qwen3_debug"), name="backbone_qwen3_debug")


def backbone_qwen3_debug_lora() -> Trainer.Config:
    """backbone_qwen3_debug with LoRA (rank 8, alpha 16) on every block, the backbone frozen;
    start it from a Hugging Face folder with --checkpoint.initial_load_in_hf."""
    graft = GraftConfig(kind="lora", layers="all", lora=LoRAConfig(rank=8, alpha=16.0, dropout=0.0))
    return debug_recipe(FAMILY.model_spec("qwen3_debug", graft=graft), name="backbone_qwen3_debug_lora", lr=1e-2)
