"""Grafts expressed as config: which decoder blocks of a pretrained backbone get what, and
what trains.

`GraftConfig` lives in the backbone's config (`DecoderLMConfig.graft`); `apply_graft`
modifies a built `DecoderLM` in place and freezes everything that does not train
(`requires_grad=False`, so torchtitan's optimizer never holds it). Layer choices:
models/layers/graft_layers.py (the thesis' ALMA / ELMA / GeMA; its appendix B.2 runs ELMA in
blocks 1, 2, which the `*_thesis` configs pass as the list "1,2"). Kinds, one row each of
`GRAFT_KINDS`: "none" leaves the backbone exactly as it is; "lora" (LoRA on the chosen
blocks); "memoryllama" (a MemoryLlama memory in the chosen blocks, models/grafts/memory_llama.py,
with LoRA optional on `lora_layers`, the thesis' recipe being LoRA on every block); "mone"
(MoNe's memory in the chosen blocks, models/grafts/mone.py; its recipe: every block, LoRA
`MONE_LORA` on W_q, W_k, W_v).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import nn

from models.grafts.lora import apply_lora, LoRAConfig, LoRALinear
from models.grafts.memory_llama import MemoryLlamaBlock, MemoryLlamaConfig
from models.grafts.mone import MoNeBlock, MoNeConfig
from models.layers.graft_layers import graft_layers


@runtime_checkable
class GraftBlock(Protocol):
    """A decoder block with a memory grafted in. It keeps the backbone block's submodules
    under their names (checkpoints and LoRA targets unchanged) and names every weight it adds
    `memory*`: `graft_parameters` is exactly those, what trains under `train="graft"`."""

    last_stats: dict[str, torch.Tensor]  # the last forward's diagnostics (`graft_diagnostics`)

    def graft_parameters(self) -> list[nn.Parameter]: ...

    def reset_graft(self) -> None: ...

    def step(self, x: torch.Tensor, positions: torch.Tensor, cache): ...  # streaming: (output, cache)


@dataclass(frozen=True)
class GraftKind:
    """One row of the graft table: the memory's config class (None: no memory) and the
    function that wraps a backbone block of width `dim` into a `GraftBlock`."""

    memory_config: type | None = None
    graft_block: Callable[[nn.Module, int, object], GraftBlock] | None = None


# Adding a kind = a module with its config and block, and one line here.
GRAFT_KINDS = {
    "none": GraftKind(),
    "lora": GraftKind(),  # LoRA alone (`GraftConfig.lora`)
    "memoryllama": GraftKind(MemoryLlamaConfig, MemoryLlamaBlock),
    "mone": GraftKind(MoNeConfig, lambda block, dim, cfg: MoNeBlock(block, cfg)),
}
TRAINS = ("graft", "all")


@dataclass
class GraftConfig:
    kind: str = "none"  # "none" | "lora" | "memoryllama" | "mone"
    layers: str = "all"  # "all" | "alma" | "elma" | "gema:<k>" | "<i>,<j>,...": the grafted blocks
    lora: LoRAConfig | None = None  # LoRA (kind "lora"; optional beside a memory)
    lora_layers: str | None = None  # the blocks LoRA goes on; None: `layers`
    memory: MemoryLlamaConfig | MoNeConfig | None = None  # the memory kinds' config (default: theirs)
    train: str = "graft"  # "graft": only what the graft adds trains; "all": the backbone too

    def __post_init__(self):
        if isinstance(self.lora, dict):
            self.lora = LoRAConfig(**self.lora)
        if self.kind not in GRAFT_KINDS:
            raise ValueError(f"graft kind '{self.kind}' unknown: choose one of {tuple(GRAFT_KINDS)}")
        memory_config = GRAFT_KINDS[self.kind].memory_config
        if isinstance(self.memory, dict) and memory_config is not None:
            self.memory = memory_config(**self.memory)
        if self.train not in TRAINS:
            raise ValueError(f"graft train '{self.train}' unknown: choose one of {TRAINS}")
        if self.kind == "lora" and self.lora is None:
            self.lora = LoRAConfig()
        if memory_config is not None and self.memory is None:
            self.memory = memory_config()
        if self.memory is not None and not isinstance(self.memory, memory_config or ()):
            raise ValueError(f"graft kind '{self.kind}' takes {memory_config.__name__ if memory_config else 'no memory'} "
                             f"config, got {type(self.memory).__name__}: set kind to its memory "
                             f"({', '.join(k for k, row in GRAFT_KINDS.items() if row.memory_config)})")


def apply_graft(model: nn.Module, cfg: GraftConfig) -> None:
    """Graft `cfg` onto a built backbone (its `layers` ModuleDict, `cfg.dim`) and freeze
    what does not train."""
    if cfg.kind == "none":
        return
    n_layers = len(model.layers)
    if cfg.lora is not None:
        apply_lora([model.layers[str(i)] for i in graft_layers(cfg.lora_layers or cfg.layers, n_layers)], cfg.lora)
    graft_block = GRAFT_KINDS[cfg.kind].graft_block
    if graft_block is not None:
        for i in graft_layers(cfg.layers, n_layers):
            model.layers[str(i)] = graft_block(model.layers[str(i)], model.cfg.dim, cfg.memory)
    if cfg.train == "graft":
        added = {id(p) for p in graft_parameters(model)}
        for parameter in model.parameters():
            parameter.requires_grad_(id(parameter) in added)


def graft_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters grafts added to `model`: LoRA factors and memories."""
    added = []
    for module in model.modules():
        if isinstance(module, LoRALinear):
            added += [*module.lora_A.parameters(), *module.lora_B.parameters()]
        elif isinstance(module, GraftBlock):
            added += module.graft_parameters()
    return added


def reset_grafts(model: nn.Module) -> None:
    """Every graft's own init (LoRA: B = 0; memories: theirs), after the backbone's."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.reset_lora()
        elif isinstance(module, GraftBlock):
            module.reset_graft()


def graft_diagnostics(model: nn.Module) -> dict[str, float]:
    """`memory/layer<i>/...`: every memory block's `last_stats` of its last forward (through wrappers)."""
    metrics = {}
    for name, block in model.named_modules():
        if isinstance(block, GraftBlock) and block.last_stats:
            layer = f"memory/layer{name.split('layers.')[-1].split('.')[0]}"
            metrics |= {f"{layer}/{k}": float(v) for k, v in block.last_stats.items()}
    return metrics
