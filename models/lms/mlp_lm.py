"""The from-scratch MLP-FFN decoder of the Locas paper (Lu et al., "Locas: Your Models are
Principled Initializers of Locally-Supported Parametric Memories", section 4: "we pretrain our
own 0.6B decoder-only transformer using two-layer MLP FFNs").

A pre-norm decoder: RMSNorm -> causal self-attention (RoPE, optional GQA) -> residual,
RMSNorm -> FFN(x) = W2 act(W1 x) -> residual, with a plain element-wise `act` (ReLU by
default, the activation Locas-MLP assumes; "gelu" and "silu" selectable) instead of a GLU.
The paper gives no shapes beyond "0.6B"; the flavors in `train_configs/mlp_lm.py` state ours.

Shapes: tokens (B, L) int64 -> logits (B, L, vocab_size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.attention import document_causal_attention
from models.layers.rope import apply_rope, rope_angles

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


@dataclass
class MLPLMConfig:
    vocab_size: int = 4096
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_dim: int = 1024
    activation: str = "relu"
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation '{self.activation}' unknown: choose one of {sorted(ACTIVATIONS)}")
        kv_heads = self.n_kv_heads or self.n_heads
        if self.dim % self.n_heads or self.n_heads % kv_heads:
            raise ValueError(f"dim {self.dim} must divide by n_heads {self.n_heads}, and n_heads by n_kv_heads {kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class Attention(nn.Module):
    def __init__(self, cfg: MLPLMConfig):
        super().__init__()
        self.cfg = cfg
        kv_dim = (cfg.n_kv_heads or cfg.n_heads) * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, doc_positions: torch.Tensor | None) -> torch.Tensor:
        """x (B, L, dim); positions (B, L) for RoPE; doc_positions (B, L) or None for masking."""
        head_dim, theta = self.cfg.head_dim, self.cfg.rope_theta
        q, k, v = (w(x).unflatten(-1, (-1, head_dim)).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        cos, sin = rope_angles(positions, head_dim, theta)
        out = document_causal_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, doc_positions)
        return self.wo(out.transpose(1, 2).flatten(-2))


class FeedForward(nn.Module):
    """FFN(x) = W2 act(W1 x): the two-layer MLP that Locas-MLP extends sideways."""

    def __init__(self, cfg: MLPLMConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)))


class Block(nn.Module):
    def __init__(self, cfg: MLPLMConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, positions, doc_positions):
        x = x + self.attention(self.attention_norm(x), positions, doc_positions)
        return x + self.feed_forward(self.ffn_norm(x))


class MLPLM(nn.Module):
    """Decoder LM with two-layer MLP FFNs. Attribute names (tok_embeddings, layers, norm,
    lm_head) follow torchtitan's decoders so its FSDP/AC/compile helpers apply unchanged."""

    # When True, forward returns the final hidden states (B, L, dim) and the caller
    # applies lm_head (torchtitan's chunked loss does so chunk by chunk).
    _skip_lm_head: bool = False

    def __init__(self, cfg: MLPLMConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.enable_weight_tying = cfg.tie_embeddings
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, init_std), residual output projections scaled by
        1/sqrt(2 n_layers); norms to one. Re-ties embeddings (needed after to_empty)."""
        std = self.cfg.init_std
        with torch.no_grad():
            if self.enable_weight_tying:
                self.lm_head.weight = self.tok_embeddings.weight
            nn.init.normal_(self.tok_embeddings.weight, std=std)
            if not self.enable_weight_tying:
                nn.init.normal_(self.lm_head.weight, std=self.cfg.dim**-0.5)
            for block in self.layers.values():
                for linear in (block.attention.wq, block.attention.wk, block.attention.wv, block.feed_forward.w1):
                    nn.init.normal_(linear.weight, std=std)
                for linear in (block.attention.wo, block.feed_forward.w2):
                    nn.init.normal_(linear.weight, std=std / math.sqrt(2 * self.cfg.n_layers))
                block.attention_norm.reset_parameters()
                block.ffn_norm.reset_parameters()
            self.norm.reset_parameters()

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks: None = None,
    ) -> torch.Tensor:
        """tokens (B, L); positions (B, L) restarting at 0 per packed document, or None
        (one document per row). `attention_masks` exists for torchtitan's call signature
        and must be None: the mask is derived from `positions`."""
        if attention_masks is not None:
            raise ValueError("MLPLM builds its own document mask from positions; pass attention_masks=None")
        length = tokens.shape[1]
        if length > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {length} exceeds max_seq_len {self.cfg.max_seq_len}")
        rope_positions = positions
        if rope_positions is None:
            rope_positions = torch.arange(length, device=tokens.device).expand_as(tokens)
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, rope_positions, positions)
        h = self.norm(h)
        return h if self._skip_lm_head else self.lm_head(h)
