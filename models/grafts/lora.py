"""LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685):
    y = W x + (alpha / r) B A dropout(x),   A (r, in) ~ kaiming-uniform, B (out, r) = 0,
so an adapted model equals its base at init. `LoRALinear` is an `nn.Linear` whose `weight`
keeps its name and tensor (a backbone checkpoint loads unchanged; freezing it leaves the
factors `lora_A.weight` / `lora_B.weight` as the only trainable part, as in peft).
`apply_lora` swaps the targeted linears of a model in place; `merge_lora` folds B A into W
(for a plain export). tests/test_grafts.py holds it equal to peft 0.21's LoRA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# The decoder blocks' linear names (models/layers/decoder.py) and Hugging Face's.
TARGETS = {"q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "o": "attention.wo",
           "gate": "feed_forward.w1", "up": "feed_forward.w3", "down": "feed_forward.w2"}


@dataclass
class LoRAConfig:
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")  # keys of TARGETS

    def __post_init__(self):
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or self.rank < 1:
            raise ValueError(f"LoRA targets {unknown} unknown (choose from {sorted(TARGETS)}) or rank {self.rank} < 1")


class LoRALinear(nn.Linear):
    """nn.Linear plus a low-rank update. x (..., in) -> (..., out)."""

    def __init__(self, base: nn.Linear, cfg: LoRAConfig):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias  # the same tensors, the same names
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Linear(base.in_features, cfg.rank, bias=False, **factory)
        self.lora_B = nn.Linear(cfg.rank, base.out_features, bias=False, **factory)
        self.lora_dropout = nn.Dropout(cfg.dropout)
        self.scaling = cfg.alpha / cfg.rank
        self.reset_lora()

    def reset_lora(self) -> None:
        """peft's init: A kaiming-uniform (a = sqrt(5)), B zero."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def apply_lora(layers: list[nn.Module], cfg: LoRAConfig) -> None:
    """Replace the targeted linears of each of `layers` (decoder blocks) by LoRALinear."""
    for layer in layers:
        for target in cfg.targets:
            parent_name, _, child = TARGETS[target].rpartition(".")
            parent = layer.get_submodule(parent_name)
            setattr(parent, child, LoRALinear(getattr(parent, child), cfg))


def merge_lora(model: nn.Module) -> None:
    """Fold every LoRALinear's B A into its weight and turn it back into a plain nn.Linear."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            merged = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
            with torch.no_grad():
                delta = (module.lora_B.weight @ module.lora_A.weight) * module.scaling
                merged.weight = nn.Parameter(module.weight + delta.to(module.weight.dtype))
            merged.bias = module.bias
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, merged)
