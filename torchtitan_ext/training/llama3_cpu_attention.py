"""CPU stand-in for torchtitan's document-causal attention backends.

FlexAttention has no backward on CPU. `DocumentCausalSDPA` subclasses torchtitan's
`VarlenAttention` so the Trainer builds the same per-document metadata for it
(`cu_seq_q` from the dataloader's positions); it then runs SDPA with the equivalent
dense (B, 1, L, L) mask: causal inside each packed document, as flex/varlen are on GPU.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import FlexAttention, VarlenAttention, VarlenMetadata

from models.layers.attention import document_causal_mask


def document_ids_from_offsets(cu_seq: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Packed document start offsets over the flattened (B*L) tokens -> (B, L) global doc ids."""
    tokens = torch.arange(batch * length, device=cu_seq.device, dtype=cu_seq.dtype)
    return (torch.searchsorted(cu_seq, tokens, right=True) - 1).view(batch, length)


class DocumentCausalSDPA(VarlenAttention):
    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        pass

    def __init__(self, config: Config) -> None:
        # Skips VarlenAttention.__init__, which activates CUDA flash kernels.
        super(VarlenAttention, self).__init__()
        if config.window_size != (-1, 0):
            raise ValueError("DocumentCausalSDPA supports causal attention only (window_size=(-1, 0))")

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: VarlenMetadata,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        batch, length = q_BLNH.shape[:2]
        mask = document_causal_mask(document_ids_from_offsets(attention_masks.cu_seq_q, batch, length))
        out = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
            attn_mask=mask, scale=scale, enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)


def use_cpu_attention(model_config) -> None:
    """Swap every flex/varlen inner attention in a torchtitan model config for the CPU path."""
    for _, _, parent, attr in list(model_config.traverse((FlexAttention.Config, VarlenAttention.Config))):
        if isinstance(parent, list):
            parent[attr] = DocumentCausalSDPA.Config()
        else:
            setattr(parent, attr, DocumentCausalSDPA.Config())


def auto_attention_backend(accelerator: bool) -> str:
    """"cpu" (DocumentCausalSDPA) without an accelerator; on GPU torchtitan's "varlen"
    (flash kernels) when a flash-attn package is installed, else "flex"."""
    if not accelerator:
        return "cpu"
    has_flash = any(importlib.util.find_spec(m) for m in ("flash_attn_interface", "flash_attn"))
    return "varlen" if has_flash else "flex"
