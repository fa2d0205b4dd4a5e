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

from dataclasses import dataclass

import torch
from torch import nn

from models.layers.decoder import DecoderLMBase
from models.layers.ffn import MLP_ACTIVATIONS


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
    # Token embeddings N(0, embedding_std); None: 1.0 when untied (torchtitan's llama3, the
    # Transformer++ baseline), init_std when tied (the table is also the output layer, whose
    # logits N(0, 1) rows would make O(sqrt(dim))). The paper states no init. With 0.02 under
    # untied embeddings the MQAR suite's row stalled at 0.26 validation accuracy after 900 steps;
    # N(0, 1) reached 0.92 (docs/benchmarks.md "Initialisation and recall").
    embedding_std: float | None = None

    def __post_init__(self):
        if self.activation not in MLP_ACTIVATIONS:
            raise ValueError(f"activation '{self.activation}' unknown: choose one of {sorted(MLP_ACTIVATIONS)}")
        kv_heads = self.n_kv_heads or self.n_heads
        if self.dim % self.n_heads or self.n_heads % kv_heads:
            raise ValueError(f"dim {self.dim} must divide by n_heads {self.n_heads}, and n_heads by n_kv_heads {kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def token_embedding_std(self) -> float:
        """The std of the token embeddings (`embedding_std`, or its default by tying)."""
        if self.embedding_std is not None:
            return self.embedding_std
        return self.init_std if self.tie_embeddings else 1.0


class MLPLM(DecoderLMBase):
    """Decoder LM with two-layer MLP FFNs (`models/layers/decoder.py`'s blocks: consecutive-pair
    RoPE, torch's RMSNorm, FFN w2 act(w1 x)). Attribute names (tok_embeddings, layers, norm,
    lm_head) follow torchtitan's decoders so its FSDP/AC/compile helpers apply unchanged."""

    def __init__(self, cfg: MLPLMConfig):
        super().__init__(cfg, cfg.ffn_dim, ffn=cfg.activation)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, init_std), residual output projections scaled by
        1/sqrt(2 n_layers); token embeddings N(0, token_embedding_std); norms to one.
        Re-ties embeddings (needed after to_empty)."""
        std = self.cfg.init_std
        with torch.no_grad():
            self._tie_embeddings()
            nn.init.normal_(self.tok_embeddings.weight, std=self.cfg.token_embedding_std)
            if not self.enable_weight_tying:
                nn.init.normal_(self.lm_head.weight, std=self.cfg.dim**-0.5)
            for block in self.layers.values():
                block.reset_parameters(std, self.cfg.n_layers)
            self.norm.reset_parameters()
