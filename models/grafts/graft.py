"""Grafts expressed as config: which decoder blocks of a pretrained backbone get what, and
what trains.

`GraftConfig` lives in the backbone's config (`DecoderLMConfig.graft`); `apply_graft`
modifies a built `DecoderLM` in place and freezes everything that does not train
(`requires_grad=False`, so torchtitan's optimizer never holds it). Layer choices (MemoryLlama
thesis, "Neural memory augmentation for LLMs", section 4; figure 4.2): "all"; "elma" = the
first two blocks; "alma" = the last two; "gema:k" = every k-th block, counted from the first
(blocks k-1, 2k-1, ...; the thesis leaves the offset open); or an explicit comma-separated
list such as "0,5,11". `kind="none"` leaves the backbone exactly as it is. Kinds: "lora" (LoRA on the chosen
blocks), "memoryllama" (a MemoryLlama memory in the chosen blocks, models/grafts/memory_llama.py,
with LoRA optional on `lora_layers`, the thesis' recipe being LoRA on every block).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from models.grafts.lora import apply_lora, LoRAConfig, LoRALinear
from models.grafts.memory_llama import MemoryLlamaBlock, MemoryLlamaConfig

KINDS = ("none", "lora", "memoryllama")
TRAINS = ("graft", "all")


@dataclass
class GraftConfig:
    kind: str = "none"  # "none" | "lora" | "memoryllama"
    layers: str = "all"  # "all" | "alma" | "elma" | "gema:<k>" | "<i>,<j>,...": the grafted blocks
    lora: LoRAConfig | None = None  # LoRA (kind "lora"; optional beside a memory)
    lora_layers: str | None = None  # the blocks LoRA goes on; None: `layers`
    memory: MemoryLlamaConfig | None = None  # kind "memoryllama" (default: MemoryLlamaConfig())
    train: str = "graft"  # "graft": only what the graft adds trains; "all": the backbone too

    def __post_init__(self):
        if isinstance(self.lora, dict):
            self.lora = LoRAConfig(**self.lora)
        if isinstance(self.memory, dict):
            self.memory = MemoryLlamaConfig(**self.memory)
        if self.kind not in KINDS:
            raise ValueError(f"graft kind '{self.kind}' unknown: choose one of {KINDS}")
        if self.train not in TRAINS:
            raise ValueError(f"graft train '{self.train}' unknown: choose one of {TRAINS}")
        if self.kind == "lora" and self.lora is None:
            self.lora = LoRAConfig()
        if self.kind == "memoryllama" and self.memory is None:
            self.memory = MemoryLlamaConfig()
        if self.kind != "memoryllama" and self.memory is not None:
            raise ValueError(f"a memory config was given for graft kind '{self.kind}': set kind='memoryllama'")


def graft_layers(spec: str, n_layers: int) -> list[int]:
    """The block indices a layer spec names in a backbone of `n_layers` blocks; ValueError
    naming the spec when it names none or one out of range."""
    if spec == "all":
        return list(range(n_layers))
    if spec in ("alma", "elma"):
        if n_layers < 2:
            raise ValueError(f"graft layers '{spec}' needs 2 blocks; the backbone has {n_layers}")
        return [n_layers - 2, n_layers - 1] if spec == "alma" else [0, 1]
    if spec.startswith("gema:"):
        k = int(spec.removeprefix("gema:"))
        if not 1 <= k <= n_layers:
            raise ValueError(f"graft layers '{spec}': k must be in 1..{n_layers}")
        return list(range(k - 1, n_layers, k))
    try:
        layers = sorted({int(i) for i in spec.split(",")})
    except ValueError:
        raise ValueError(f"graft layers '{spec}' unknown: all, alma, elma, gema:<k> or a list like 0,5,11") from None
    if layers[0] < 0 or layers[-1] >= n_layers:
        raise ValueError(f"graft layer {layers[-1] if layers[-1] >= n_layers else layers[0]} is out of range: "
                         f"the backbone has blocks 0..{n_layers - 1}")
    return layers


def apply_graft(model: nn.Module, cfg: GraftConfig) -> None:
    """Graft `cfg` onto a built backbone (its `layers` ModuleDict, `cfg.dim`) and freeze
    what does not train."""
    if cfg.kind == "none":
        return
    n_layers = len(model.layers)
    if cfg.lora is not None:
        apply_lora([model.layers[str(i)] for i in graft_layers(cfg.lora_layers or cfg.layers, n_layers)], cfg.lora)
    if cfg.kind == "memoryllama":
        for i in graft_layers(cfg.layers, n_layers):
            model.layers[str(i)] = MemoryLlamaBlock(model.layers[str(i)], model.cfg.dim, cfg.memory)
    if cfg.train == "graft":
        added = {id(p) for p in graft_parameters(model)}
        for parameter in model.parameters():
            parameter.requires_grad_(id(parameter) in added)


def graft_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters grafts added to `model`: LoRA factors and MemoryLlama memories."""
    added = []
    for module in model.modules():
        if isinstance(module, LoRALinear):
            added += [*module.lora_A.parameters(), *module.lora_B.parameters()]
        elif isinstance(module, MemoryLlamaBlock):
            added += module.graft_parameters()
    return added


def reset_grafts(model: nn.Module) -> None:
    """Every graft's own init (LoRA: B = 0; MemoryLlama: its `init`), after the backbone's."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.reset_lora()
        elif isinstance(module, MemoryLlamaBlock):
            module.reset_graft()
