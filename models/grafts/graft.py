"""Grafts expressed as config: which decoder blocks of a pretrained backbone get what, and
what trains.

`GraftConfig` lives in the backbone's config (`DecoderLMConfig.graft`); `apply_graft`
modifies a built `DecoderLM` in place and freezes everything that does not train
(`requires_grad=False`, so torchtitan's optimizer never holds it). Layer choices (MemoryLlama
thesis, "Neural memory augmentation for LLMs", section 4; figure 4.2): "all"; "elma" = the
first two blocks (0, 1; the thesis' appendix B.2 runs ELMA in blocks 1, 2, which its
`*_thesis` configs pass as the list "1,2"); "alma" = the last two; "gema:k" = every k-th block, counted from the first
(blocks k-1, 2k-1, ...; the thesis leaves the offset open); or an explicit comma-separated
list such as "0,5,11". `kind="none"` leaves the backbone exactly as it is. Kinds: "lora" (LoRA on the chosen
blocks), "memoryllama" (a MemoryLlama memory in the chosen blocks, models/grafts/memory_llama.py,
with LoRA optional on `lora_layers`, the thesis' recipe being LoRA on every block), "mone"
(MoNe's memory in the chosen blocks, models/grafts/mone.py; its recipe: every block, LoRA
`MONE_LORA` on W_q, W_k, W_v).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from models.grafts.lora import apply_lora, LoRAConfig, LoRALinear
from models.grafts.memory_llama import MemoryLlamaBlock, MemoryLlamaConfig
from models.grafts.mone import MoNeBlock, MoNeConfig

KINDS = ("none", "lora", "memoryllama", "mone")
MEMORY_CONFIGS = {"memoryllama": MemoryLlamaConfig, "mone": MoNeConfig}
MEMORY_BLOCKS = (MemoryLlamaBlock, MoNeBlock)
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
        if self.kind not in KINDS:
            raise ValueError(f"graft kind '{self.kind}' unknown: choose one of {KINDS}")
        memory_config = MEMORY_CONFIGS.get(self.kind)
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
                             f"({', '.join(MEMORY_CONFIGS)})")


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
    if cfg.kind == "mone":
        for i in graft_layers(cfg.layers, n_layers):
            model.layers[str(i)] = MoNeBlock(model.layers[str(i)], cfg.memory)
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
        elif isinstance(module, MEMORY_BLOCKS):
            added += module.graft_parameters()
    return added


def reset_grafts(model: nn.Module) -> None:
    """Every graft's own init (LoRA: B = 0; memories: theirs), after the backbone's."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.reset_lora()
        elif isinstance(module, MEMORY_BLOCKS):
            module.reset_graft()


def graft_diagnostics(model: nn.Module) -> dict[str, float]:
    """`memory/layer<i>/...`: every memory block's `last_stats` of its last forward (through wrappers)."""
    metrics = {}
    for name, block in model.named_modules():
        if isinstance(block, MEMORY_BLOCKS) and block.last_stats:
            layer = f"memory/layer{name.split('layers.')[-1].split('.')[0]}"
            metrics |= {f"{layer}/{k}": float(v) for k, v in block.last_stats.items()}
    return metrics
