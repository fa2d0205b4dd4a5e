"""The toy family's model (what `models/<family>.py` holds: torch and `models/` imports only,
so it ships inside a Hugging Face export). tests/toy_family.py registers it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.layers.decoder import DecoderBlock


@dataclass
class ToyConfig:
    vocab_size: int = 4096
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 2
    max_seq_len: int = 4096


class ToyLM(nn.Module):
    """Pre-norm decoder (Mela's decoder blocks). tokens (B, T) -> logits (B, T, vocab)."""

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): DecoderBlock(cfg.dim, cfg.n_heads, cfg.n_heads, 4 * cfg.dim, 10000.0, 1e-6)
                                     for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.enable_weight_tying = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.tok_embeddings.weight, std=0.02)
            nn.init.normal_(self.lm_head.weight, std=self.cfg.dim**-0.5)
            for block in self.layers.values():
                block.reset_parameters(0.02, self.cfg.n_layers)
            self.norm.reset_parameters()

    def forward(self, tokens: torch.Tensor, positions=None, attention_masks=None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, torch.arange(tokens.shape[1], device=tokens.device))
        return self.lm_head(self.norm(h))
