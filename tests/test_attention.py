"""Document-causal attention: the CPU paths agree with a plain per-query reference."""

from __future__ import annotations

import math

import pytest
import torch
from torchtitan.models.common.attention import create_varlen_metadata_for_document

from models.layers.attention import _flex_document_attention, document_causal_attention, document_ids
from torchtitan_ext.training.llama3_cpu_attention import DocumentCausalSDPA


def reference_attention(q, k, v, positions):
    """Loop over queries: softmax over keys j <= i of the same document. q,k,v (B, H, L, D)."""
    batch, heads, length, dim = q.shape
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    out = torch.zeros_like(q)
    for b in range(batch):
        doc_start = 0
        for i in range(length):
            if positions[b, i] == 0:
                doc_start = i
            scores = (q[b, :, i : i + 1] @ k[b, :, doc_start : i + 1].transpose(-1, -2)) / math.sqrt(dim)
            out[b, :, i] = (scores.softmax(-1) @ v[b, :, doc_start : i + 1])[:, 0]
    return out


def random_positions(batch, length, generator):
    """Packed documents of random lengths; each row starts a document at 0."""
    rows = []
    for _ in range(batch):
        row, pos = [], 0
        for _ in range(length):
            if pos > 0 and torch.rand((), generator=generator) < 0.15:
                pos = 0
            row.append(pos)
            pos += 1
        rows.append(row)
    return torch.tensor(rows)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_models_attention_matches_reference(kv_heads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, kv_heads, 40, 8, dtype=torch.float64, generator=g) for _ in range(2))
    positions = random_positions(2, 40, g)
    torch.testing.assert_close(document_causal_attention(q, k, v, positions), reference_attention(q, k, v, positions))
    plain = torch.arange(40).expand(2, 40)
    torch.testing.assert_close(document_causal_attention(q, k, v, None), reference_attention(q, k, v, plain))


def test_flex_path_matches_sdpa_path_forward():
    """The GPU (flex) path computes the same as the CPU path; forward runs on CPU too."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 128, 16, generator=g) for _ in range(3))
    positions = random_positions(2, 128, g)
    flex = _flex_document_attention(q, k, v, document_ids(positions), None, False)
    torch.testing.assert_close(flex, document_causal_attention(q, k, v, positions), atol=1e-5, rtol=1e-5)


def test_torchtitan_cpu_attention_matches_reference():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(3, 24, 2, 8, dtype=torch.float64, generator=g) for _ in range(3))  # (B, L, N, H)
    positions = random_positions(3, 24, g)
    attention = DocumentCausalSDPA(DocumentCausalSDPA.Config())
    out = attention(q, k, v, attention_masks=create_varlen_metadata_for_document(positions))
    expected = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions)
    torch.testing.assert_close(out, expected.transpose(1, 2))


def test_backend_choice_follows_device_and_flash_attn(monkeypatch):
    import importlib.util

    from torchtitan_ext.training.llama3_cpu_attention import auto_attention_backend

    assert auto_attention_backend(accelerator=False) == "cpu"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert auto_attention_backend(accelerator=True) == "flex"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else None)
    assert auto_attention_backend(accelerator=True) == "varlen"


@pytest.mark.parametrize("mask_name", ["window", "mac"])
def test_masked_attention_flex_path_matches_dense_path(mask_name):
    from models.layers.attention import _flex_masked_attention, masked_attention
    from models.lms.titans import mac_mask, prefix_window_mask

    g = torch.Generator().manual_seed(3)
    mask_mod, kv_len = {"window": (prefix_window_mask(4, 16), 4 + 128), "mac": (mac_mask(4, 64), 4 + 128)}[mask_name]
    q_len = 128 if mask_name == "window" else 64
    q = torch.randn(1, 2, q_len, 16, generator=g)
    k, v = (torch.randn(1, 2, kv_len, 16, generator=g) for _ in range(2))
    flex = _flex_masked_attention(q, k, v, mask_mod, None, False)
    torch.testing.assert_close(flex, masked_attention(q, k, v, mask_mod), atol=1e-5, rtol=1e-5)


def test_a_chunk_of_queries_over_a_cache_is_the_last_rows_of_full_attention():
    """Queries of the last Lq tokens over all Lk keys (MemoryLlama's chunk over its cache)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 40, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 2, 40, 8, dtype=torch.float64, generator=g) for _ in range(2))
    positions = random_positions(2, 40, g)
    for docs in (positions, None):
        full = reference_attention(q, k, v, positions if docs is not None else torch.arange(40).expand(2, 40))
        for start in (0, 13, 39):
            torch.testing.assert_close(document_causal_attention(q[:, :, start:], k, v, docs), full[:, :, start:])
