"""Every way to graft memory onto a pretrained backbone, in one table: `GRAFT_KINDS`
{kind: `GraftKind`(config class, build, FLOP count, form)}.

The form says when and how a kind goes in:
- "trained_block": trained with the model. `GraftConfig` lives in the backbone's config
  (`DecoderLMConfig.graft`); `apply_graft` wraps the chosen decoder blocks of a built
  `DecoderLM` in place (`build(block, dim, memory config) -> GraftBlock`) and freezes
  everything that does not train (`requires_grad=False`, so torchtitan's optimizer never
  holds it). Rows: "none" leaves the backbone exactly as it is; "lora" (LoRA on the chosen
  blocks, `GraftConfig.lora`, which any block kind may add); "memoryllama" (a MemoryLlama
  memory in the chosen blocks, models/grafts/memory_llama.py, with LoRA optional on
  `lora_layers`, the thesis' recipe being LoRA on every block); "mone" (MoNe's memory in the
  chosen blocks, models/grafts/mone.py; its recipe: every block, LoRA `MONE_LORA` on W_q,
  W_k, W_v).
- "trained_lm": trained with the model, but the memory is held by an LM of its own that runs
  its forward around it (`build(dim, vocab_size, memory config)` -> that memory module):
  "gradmem" (GradMem's prefix memory, models/memory/gradmem.py, held by
  models/grafts/gradmem.py's `GradMemLM`; its own family, torchtitan_ext/families/gradmem.py).
- "test_time": attached to a trained model when it reads (`build(model, config)` -> the
  attached memories, everything else frozen): "locas" (Locas' sideways FFN memories,
  models/memory/locas.py's `attach_locas`; torchtitan_ext/eval/whole_book.py's `--ttt
  locas_glu|locas_mlp`).

The FLOP column (None: the kind adds no matmul of its own) counts on the primitives of
models/layers/flops.py, beside each kind's code, with the form's signature:
- trained_block: `flops(cfg: DecoderLMConfig, seq_len) -> (backbone, graft)`: forward FLOPs
  per token the kind's blocks change in the backbone (signed) and add; the backbone family's
  count (torchtitan_ext/families/backbone.py) applies the training multipliers and adds LoRA;
- trained_lm: `flops(cfg, seq_len)`: training FLOPs per token of the whole LM (its family's count);
- test_time: `flops(cfg, n_layers, dim)`: forward FLOPs per token the attached memories add.

Layer choices: models/layers/graft_layers.py (the thesis' ALMA / ELMA / GeMA; its appendix
B.2 runs ELMA in blocks 1, 2, which the `*_thesis` configs pass as the list "1,2"). Every
weight a memory adds is named `memory*` (`GraftBlock`; LoRA's are `lora_A`, `lora_B`), which
is how the backbone's Hugging Face key map (torchtitan_ext/families/backbone.py,
`is_graft_key`) tells a graft's weights from the backbone's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import nn

from models.grafts.lora import apply_lora, LoRAConfig, LoRALinear
from models.grafts.memory_llama import memory_llama_flops, MemoryLlamaBlock, MemoryLlamaConfig
from models.grafts.mone import MoNeBlock, MoNeConfig, mone_flops
from models.layers.graft_layers import graft_layers
from models.memory.gradmem import GradMem, GradMemConfig, gradmem_flops
from models.memory.locas import attach_locas, locas_flops, LocasConfig


@runtime_checkable
class GraftBlock(Protocol):
    """A decoder block with a memory grafted in. It keeps the backbone block's submodules
    under their names (checkpoints and LoRA targets unchanged) and names every weight it adds
    `memory*`: `graft_parameters` is exactly those, what trains under `train="graft"`."""

    last_stats: dict[str, torch.Tensor]  # the last forward's diagnostics (`graft_diagnostics`)

    def graft_parameters(self) -> list[nn.Parameter]: ...

    def reset_graft(self) -> None: ...

    def step(self, x: torch.Tensor, positions: torch.Tensor, cache): ...  # streaming: (output, cache)

    def keep_last(self, cache, tokens: int): ...  # a bounded stream's cache: attention keeps `tokens` tokens


FORMS = {"trained_block": "a block graft a backbone's config holds (DecoderLMConfig.graft)",
         "trained_lm": "an LM of its own, trained as its family (torchtitan_ext/families/)",
         "test_time": "attached to a trained model at test time (e.g. --ttt of scripts/eval_long_ppl.py)"}


@dataclass(frozen=True)
class GraftKind:
    """One row of the graft table (module docstring): the memory's config class (None: no
    memory), how the memory is built in and its FLOP count, both with the signature of the
    row's `form` (a key of FORMS: trained as a block or as an LM, or attached at test time)."""

    config: type | None = None
    build: Callable | None = None
    flops: Callable | None = None
    form: str = "trained_block"

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"graft form '{self.form}' unknown: choose one of {tuple(FORMS)}")


# Adding a kind = a module with its config, block (or attach function) and FLOP count, and one line here.
GRAFT_KINDS = {
    "none": GraftKind(),
    "lora": GraftKind(),  # LoRA alone (`GraftConfig.lora`, counted by the backbone family for every kind)
    "memoryllama": GraftKind(MemoryLlamaConfig, MemoryLlamaBlock, memory_llama_flops),
    "mone": GraftKind(MoNeConfig, lambda block, dim, cfg: MoNeBlock(block, cfg), mone_flops),
    "gradmem": GraftKind(GradMemConfig, GradMem, gradmem_flops, "trained_lm"),
    "locas": GraftKind(LocasConfig, attach_locas, locas_flops, "test_time"),
}
TRAINS = ("graft", "all")


@dataclass
class GraftConfig:
    kind: str = "none"  # a "trained_block" row of GRAFT_KINDS: "none" | "lora" | "memoryllama" | "mone"
    layers: str = "all"  # "all" | "alma" | "elma" | "gema:<k>" | "<i>,<j>,...": the grafted blocks
    lora: LoRAConfig | None = None  # LoRA (kind "lora"; optional beside a memory)
    lora_layers: str | None = None  # the blocks LoRA goes on; None: `layers`
    memory: MemoryLlamaConfig | MoNeConfig | None = None  # the memory kinds' config (default: theirs)
    train: str = "graft"  # "graft": only what the graft adds trains; "all": the backbone too

    def __post_init__(self):
        if isinstance(self.lora, dict):
            self.lora = LoRAConfig(**self.lora)
        blocks = tuple(k for k, row in GRAFT_KINDS.items() if row.form == "trained_block")
        if self.kind not in GRAFT_KINDS:
            raise ValueError(f"graft kind '{self.kind}' unknown: choose one of {blocks}")
        if self.kind not in blocks:
            raise ValueError(f"graft kind '{self.kind}' is {FORMS[GRAFT_KINDS[self.kind].form]}, not a block "
                             f"graft: choose one of {blocks}")
        memory_config = GRAFT_KINDS[self.kind].config
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
                             f"({', '.join(k for k in blocks if GRAFT_KINDS[k].config)})")


def apply_graft(model: nn.Module, cfg: GraftConfig) -> None:
    """Graft `cfg` onto a built backbone (its `layers` ModuleDict, `cfg.dim`) and freeze
    what does not train."""
    if cfg.kind == "none":
        return
    n_layers = len(model.layers)
    if cfg.lora is not None:
        apply_lora([model.layers[str(i)] for i in graft_layers(cfg.lora_layers or cfg.layers, n_layers)], cfg.lora)
    graft_block = GRAFT_KINDS[cfg.kind].build
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
