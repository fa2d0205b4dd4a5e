"""Causal attention inside packed documents, on any device.

Convention (shared with torchtitan's data pipeline): `positions` (B, L) restarts at 0
where a new document starts; a token attends to itself and earlier tokens of its own
document only. `positions=None` means one document per row (plain causal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(B, L) positions -> (B, L) document index within the row (0, 1, ...)."""
    return torch.cumsum(positions == 0, dim=1) - 1


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) document ids -> (B, 1, L, L) bool, True where query i may attend key j."""
    length = doc_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same_doc & causal)[:, None]


def _flex_document_attention(q, k, v, doc_ids, scale, enable_gqa):
    """Flex-attention path (GPU): the same mask as `document_causal_attention`'s, block-sparse.
    doc_ids (B, Lk); the queries are the last Lq of the Lk tokens."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    offset = k.shape[2] - q.shape[2]

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx + offset >= kv_idx) & (doc_ids[b, q_idx + offset] == doc_ids[b, kv_idx])

    block_mask = create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def document_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D) with Hq a multiple of Hkv and Lq <= Lk -> (B, Hq, Lq, D).

    The queries are the last Lq of the Lk tokens (Lq < Lk: a chunk attending to a cache of
    the Lk - Lq tokens before it and to itself); `positions` (B, Lk) covers the keys.
    CUDA with document boundaries: flex attention; otherwise SDPA (is_causal for one
    document per row and Lq = Lk, else an explicit (B, 1, Lq, Lk) mask).
    """
    enable_gqa = q.shape[1] != k.shape[1]
    offset = k.shape[2] - q.shape[2]
    if positions is None:
        if offset == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(offset)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale, enable_gqa=enable_gqa)
    doc_ids = document_ids(positions)
    if q.is_cuda:
        return _flex_document_attention(q, k, v, doc_ids, scale, enable_gqa)
    mask = document_causal_mask(doc_ids)[:, :, offset:]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def _block_mask(mask_mod, q_len: int, k_len: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, qi, ki: mask_mod(qi, ki), None, None, q_len, k_len, device=device)


def flex_block_mask(mask_mod, q_len: int, k_len: int, device):
    """`mask_mod`'s block-sparse mask for `masked_attention` on CUDA (None elsewhere, where the
    dense mask is cheap): built once and passed to every call of the same shape, so a loop
    over equal segments neither rebuilds it nor changes its structure between steps (CUDA
    graphs)."""
    return _block_mask(mask_mod, q_len, k_len, device) if torch.device(device).type == "cuda" else None


def _flex_masked_attention(q, k, v, mask_mod, scale, enable_gqa, block_mask=None):
    """Flex-attention path (GPU): the mask as a block-sparse BlockMask (`block_mask`, or built here)."""
    from torch.nn.attention.flex_attention import flex_attention

    if block_mask is None:
        block_mask = _block_mask(mask_mod, q.shape[2], k.shape[2], q.device)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_mod, scale: float | None = None,
                     block_mask=None) -> torch.Tensor:
    """Attention under any mask. q (B, H, Lq, D), k/v (B, Hkv, Lk, D) -> (B, H, Lq, D).

    `mask_mod(q_idx, kv_idx)` returns True where a query may attend a key; it is written
    once and evaluated two ways: as a block-sparse flex-attention mask on CUDA (`block_mask`
    when given: `flex_block_mask(mask_mod, Lq, Lk)`), and as a dense (Lq, Lk) mask for SDPA
    elsewhere (FlexAttention has no CPU backward).
    """
    enable_gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        return _flex_masked_attention(q, k, v, mask_mod, scale, enable_gqa, block_mask)
    q_idx = torch.arange(q.shape[2], device=q.device)[:, None]
    kv_idx = torch.arange(k.shape[2], device=q.device)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_mod(q_idx, kv_idx), scale=scale, enable_gqa=enable_gqa)
