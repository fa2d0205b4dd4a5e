"""A Llama / Qwen3 decoder with a GradMem prefix memory (`models/memory/gradmem.py`, the "gradmem"
row of `models/grafts/graft.py`'s GRAFT_KINDS, whose `build` and config class this LM uses): trained
from scratch (the paper's 4-layer, 4-head, 128-wide Llama on KV-retrieval) or grafted onto a
pretrained backbone loaded from Hugging Face (the backbone frozen, optionally with LoRA).

One training row holds one sample, [context; query; answer; padding], and its `positions`
restart at 0 where the query starts: the context and the query are two documents, and the
read never attends to the context. `forward` writes each row's context into its memory
(K gradient steps, or forward writes), reads [memory; query; answer] and returns the read's
hidden states (or logits) in the row's layout, zero at the context's positions (which carry
no labels), with the per-sample write loss L_write(M_{K-1}; C) of the last gradient step (the
public code's term for the outer objective, weighted by the loss: `torchtitan_ext/families/gradmem.py`).
Finding where each row's query starts reads the data (one host sync per call).

Shapes: tokens, positions (B, L) -> ((B, L, vocab) logits or (B, L, dim) hidden, (B,) write loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from models.backbones.decoder_lm import DecoderLM, DecoderLMConfig
from models.grafts.graft import GRAFT_KINDS, graft_parameters
from models.memory.gradmem import GradMemConfig


@dataclass
class GradMemLMConfig(DecoderLMConfig):
    gradmem: GradMemConfig = field(default_factory=GradMemConfig)
    train_backbone: bool = True  # False: only the memory (and a LoRA graft's factors) train

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.gradmem, dict):
            self.gradmem = GRAFT_KINDS["gradmem"].config(**self.gradmem)
        if self.graft.kind not in ("none", "lora"):
            raise ValueError(f"GradMem takes graft kind 'none' or 'lora' beside its memory, not '{self.graft.kind}'")


def query_starts(positions: torch.Tensor | None) -> torch.Tensor:
    """(B, L) positions -> (B,) index of each row's query: where positions first restart at 0."""
    if positions is None:
        raise ValueError("GradMem rows hold [context; query]: pass positions that restart at 0 where the query starts")
    restarts = positions[:, 1:] == 0
    if not bool(restarts.any(1).all()):
        raise ValueError("a GradMem row has no query: its positions must restart at 0 where the query starts")
    return restarts.int().argmax(1) + 1


class GradMemLM(DecoderLM):
    """DecoderLM + GradMem (module docstring)."""

    def __init__(self, cfg: GradMemLMConfig):
        super().__init__(cfg)
        self.gradmem = GRAFT_KINDS["gradmem"].build(cfg.dim, cfg.vocab_size, cfg.gradmem)
        if not cfg.train_backbone:
            trainable = {id(p) for p in [*graft_parameters(self), *self.gradmem.parameters()]}
            for parameter in self.parameters():
                parameter.requires_grad_(id(parameter) in trainable)

    def reset_parameters(self) -> None:
        """The backbone's init, then the memory's (M_0, P = identity, Delta = 0)."""
        super().reset_parameters()
        if hasattr(self, "gradmem"):  # DecoderLM.__init__ resets before the memory exists
            self.gradmem.reset_parameters()

    def write(self, context: torch.Tensor, lengths: torch.Tensor,
              steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """WRITE: context (B, N) right-padded past lengths (B,) -> (memory (B, m, dim) float32,
        write losses (K, B)); `steps`: K for this call (default the config's)."""
        return self.gradmem.write(self, context, lengths, steps)

    def read(self, memory: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """READ: memory (B, m, dim), tokens (B, R) -> logits (B, R, vocab)."""
        return self.lm_head(self.gradmem.read(self, memory, tokens))

    def write_loss(self, memory: torch.Tensor, context: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """L_write(memory; context) per sample (B,), e.g. of the memory a write returned."""
        return self.gradmem.reconstruction_loss(self, memory, context, lengths)

    def generate(self, context: torch.Tensor, lengths: torch.Tensor, query: torch.Tensor, new_tokens: int,
                 steps: int | None = None) -> torch.Tensor:
        """Greedy answers from the written memory alone: context (B, N) right-padded past
        lengths (B,), query (B, Q) -> (B, new_tokens) token ids."""
        with torch.no_grad():
            memory, _ = self.write(context, lengths, steps)
            tokens = query
            for _ in range(new_tokens):
                tokens = torch.cat([tokens, self.read(memory, tokens)[:, -1:].argmax(-1)], 1)
        return tokens[:, query.shape[1]:]

    def stream(self, tokens, state=None):
        raise NotImplementedError("GradMem reads from a written memory, not a stream: call write(context, lengths), "
                                  "then read(memory, query)")

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, attention_masks: None = None):
        """tokens (B, L) rows of [context; query; answer; padding]; positions (B, L) restarting
        at 0 where the query starts (module docstring)."""
        if attention_masks is not None:
            raise ValueError("GradMemLM builds its own masks; pass attention_masks=None")
        batch, length = tokens.shape
        starts = query_starts(positions)
        first, last = torch.stack(starts.aminmax()).tolist()  # the one host sync
        memory, losses = self.write(tokens[:, :last], starts)
        steps = torch.arange(length - first, device=tokens.device)
        read_tokens = tokens.gather(1, (starts[:, None] + steps).clamp(max=length - 1))
        h = self.gradmem.read(self, memory, read_tokens)  # (B, R, dim)
        offsets = torch.arange(length, device=tokens.device) - starts[:, None]  # (B, L): index into the read
        out = h.gather(1, offsets.clamp(min=0)[..., None].expand(-1, -1, h.shape[-1]))
        out = out * (offsets >= 0)[..., None].to(out.dtype)
        write_loss = losses[-1] if losses.shape[0] else h.new_zeros(batch).float()
        return (out if self._skip_lm_head else self.lm_head(out)), write_loss
