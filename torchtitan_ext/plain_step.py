"""The plain-torch training step of a family flavor, without torchtitan: what
scripts/bench_models.py times on a GPU and `torchtitan_ext.step_cost` records on the meta
device, from one definition.

`build(name, flavor)`: the family's `models/` class at that flavor (the Transformer++ is
torchtitan's llama3 in training; here the same shape as the project's plain Llama decoder,
models/backbones/decoder_lm.py, whose RoPE layout alone differs) with its training FLOPs per
token; `fitted_length`; `inputs` (random tokens, GradMem's positions); `loss_of` (next-token
cross-entropy in fp32 plus a model's own loss terms).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from torchtitan_ext import flops
from torchtitan_ext.families import family_and_overrides


def transformer_flops(cfg, seq_len: int) -> float:
    """torchtitan's count for its llama3: 6 x non-embedding parameters + attention scores and values."""
    block = flops.decoder_block_linears(cfg) + flops.attention_span(cfg.n_heads * cfg.head_dim, seq_len)
    return flops.TRAIN * (cfg.n_layers * block + flops.linear(cfg.dim, cfg.vocab_size))


def build(name: str, flavor: str):
    """(plain model, its config, flops_per_token(seq_len)) of family "<family>[_<variant>]" at
    `flavor`, built on the current default device (`with torch.device("meta")` for shapes only)."""
    family, overrides = family_and_overrides(name)
    cfg = family.config(flavor, **overrides)
    if family.name == "transformer":
        from models.backbones.decoder_lm import DecoderLM, DecoderLMConfig

        cfg = DecoderLMConfig(architecture="llama", vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers,
                              n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, ffn_hidden=cfg.ffn_hidden,
                              max_seq_len=cfg.max_seq_len)
        return DecoderLM(cfg), cfg, lambda t: transformer_flops(cfg, t)
    model = family.plain_class(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    count = family.flops_per_token
    return model, cfg, (lambda t: count(cfg, t)) if count else (lambda t: 6.0 * n_params)


def fitted_length(cfg, wanted: int) -> int:
    """`wanted` fitted to the model: at most its max_seq_len (GradMem's kv: 1024), at least
    `min_trainable_seq_len`, a multiple of Mela's chunk of tokens."""
    step = getattr(cfg, "chunk_tokens", 1)
    length = max(min(wanted, getattr(cfg, "max_seq_len", wanted)), getattr(cfg, "min_trainable_seq_len", 1))
    return math.ceil(length / step) * step


def inputs(family_name: str, batch: int, seq_len: int, vocab: int, device) -> dict:
    """Random tokens (B, T + 1) and, for GradMem, positions restarting where the query starts (T / 2)."""
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), device=device)
    out = {"tokens": tokens}
    if family_name == "gradmem":
        half = seq_len // 2
        row = torch.cat([torch.arange(half), torch.arange(seq_len - half)]).to(device)
        out["positions"] = row.expand(batch, -1)
    return out


def loss_of(model, batch: dict) -> torch.Tensor:
    """Next-token cross-entropy (fp32 logits) of `inputs`' batch plus a model's own loss terms
    (extra floating outputs that require grad, meaned: GradMem's write loss (B,))."""
    tokens = batch["tokens"]
    kwargs = {"positions": batch["positions"]} if "positions" in batch else {}
    out = model(tokens[:, :-1], **kwargs)
    logits, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    for extra in rest:
        if isinstance(extra, torch.Tensor) and extra.requires_grad and extra.is_floating_point():
            loss = loss + extra.float().mean()
    return loss
