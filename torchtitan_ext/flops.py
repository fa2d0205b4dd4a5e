"""The shared pieces of the training FLOP counts behind MFU (torchtitan's `get_nparams_and_flops`):
per-product counts, attention spans, the neural memory's work per token, a decoder block's
linears. Each family's own count lives beside its registry entry, as `flops_per_token(config,
seq_len)` in `torchtitan_ext/families/<family>.py` (e.g. `torchtitan_ext.families.titans.flops_per_token`);
the torchtitan model class (`families/plain_model.py`) calls it, or counts 6 x parameters where a
family has none.

torchtitan's dense estimate (6N + attention) fits a Transformer, not a memory model: Mela's
HMM runs at patch rate through H*L + H module steps (the first H-1 cycles forward only), and
a neural memory spends per chunk on MLP reads, explicit gradients and Newton-Schulz what its
parameter count does not show. Here each family's matmul FLOPs (2 m n k per product:
projections, attention scores and values over the attended span, memory MLP reads and
gradients, Newton-Schulz, convolutions) are summed per token for one forward, then
multiplied by 3 where the forward runs with gradients (backward = 2x forward) and by 1 where
it does not. Elementwise work (norms, gates, activations, the scan's decay products) is not
counted, as in torchtitan's estimate. Attention spans follow torchtitan's convention (the
causal mask's savings are not subtracted); a sliding window attends over min(seq_len, window).
tests/test_flops.py checks each count against torch's FlopCounterMode over a training step.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

TRAIN, FORWARD_AND_INPUT_GRAD, FORWARD_ONLY = 3, 2, 1
# FlopCounterMode's `custom_mapping` for the CPU attention kernel, which it does not count by itself.
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(grad, q, k, v),
}


def linear(d_in: int, d_out: int) -> float:
    return 2 * d_in * d_out


def attention_span(queries_dim: int, keys: float) -> float:
    """Scores and values of one query over `keys` keys: 2 products of 2 * keys * dim."""
    return 4 * keys * queries_dim


def memory_mlp(cfg) -> float:
    """One input through the memory MLP of every head (cfg: a `NeuralMemoryConfig`)."""
    return cfg.n_heads * sum(linear(i, o) for i, o in cfg.layer_shapes())


def newton_schulz(rows: int, cols: int, steps: int) -> float:
    """Muon's iteration on one matrix: per step X X^T, A A and (bA + cA^2) X (r = min side)."""
    r, c = sorted((rows, cols))
    return steps * (2 * r * r * c + 2 * r**3 + 2 * r * r * c)


def neural_memory(cfg) -> float:
    """Forward FLOPs per written token: projections, conv, memory reads of q and k, the
    explicit gradient (back through all but the first matrix, then K weighted outer-product
    sums: K = 2 for the per-token rule, 1 per chunk), Newton-Schulz per chunk, the output
    projection (when on)."""
    inner = cfg.n_heads * cfg.head_dim
    shapes = cfg.layer_shapes()
    flops = linear(cfg.dim, 3 * inner) + linear(cfg.dim, 3 * cfg.n_heads)
    flops += linear(inner, cfg.dim) if cfg.output_proj else 0
    flops += 2 * 3 * inner * cfg.conv_kernel
    flops += linear(cfg.dim, cfg.n_heads) if cfg.output_gate else 0
    weightings = 2 if cfg.gates == "token" else 1
    backprop = cfg.n_heads * sum(linear(i, o) for i, o in shapes[1:])
    flops += 2 * memory_mlp(cfg) + backprop + weightings * memory_mlp(cfg)
    if cfg.newton_schulz_steps:
        flops += cfg.n_heads * sum(newton_schulz(i, o, cfg.newton_schulz_steps) for i, o in shapes) / cfg.chunk_size
    return flops


def decoder_block_linears(cfg) -> float:
    """One token through one decoder block's GQA projections (explicit head_dim) and SwiGLU FFN
    (cfg: a `DecoderLMConfig`)."""
    d, q, kv = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return 2 * linear(d, q) + 2 * linear(d, kv) + 3 * linear(d, cfg.ffn_hidden)
