"""The matmul FLOP primitives every count is written in: the families' counts behind MFU
(`torchtitan_ext/families/<family>.py`, through `torchtitan_ext/flops.py`) and the graft
kinds' counts beside their code (the FLOP column of `models/grafts/graft.py`'s `GRAFT_KINDS`).

Conventions: 2 m n k per product (projections, attention scores and values over the attended
span, memory MLP reads and gradients, Newton-Schulz, convolutions), summed per token for one
forward, then multiplied by `TRAIN` (3) where the forward runs with gradients (backward = 2x
forward), by `FORWARD_AND_INPUT_GRAD` (2) for a frozen weight whose input still needs its
gradient, and by `FORWARD_ONLY` (1) where no backward runs. Elementwise work (norms, gates,
activations, the scan's decay products) is not counted, as in torchtitan's estimate.
Attention spans follow torchtitan's convention (the causal mask's savings are not
subtracted).
"""

from __future__ import annotations

from models.layers.graft_layers import graft_layers

TRAIN, FORWARD_AND_INPUT_GRAD, FORWARD_ONLY = 3, 2, 1


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
    projection (when on); the per-token rule's state mix per chunk ([M; S] <- 2 x 2 mix of
    [M; S] as one batched matmul, 8 FLOPs per weight: `token_scan_update`)."""
    inner = cfg.n_heads * cfg.head_dim
    shapes = cfg.layer_shapes()
    flops = linear(cfg.dim, 3 * inner) + linear(cfg.dim, 3 * cfg.n_heads)
    flops += linear(inner, cfg.dim) if cfg.output_proj else 0
    flops += 2 * 3 * inner * cfg.conv_kernel
    flops += linear(cfg.dim, cfg.n_heads) if cfg.output_gate else 0
    weightings = 2 if cfg.gates == "token" else 1
    backprop = cfg.n_heads * sum(linear(i, o) for i, o in shapes[1:])
    flops += 2 * memory_mlp(cfg) + backprop + weightings * memory_mlp(cfg)
    if cfg.gates == "token":
        flops += cfg.n_heads * sum(8 * i * o for i, o in shapes) / cfg.chunk_size
    if cfg.newton_schulz_steps:
        flops += cfg.n_heads * sum(newton_schulz(i, o, cfg.newton_schulz_steps) for i, o in shapes) / cfg.chunk_size
    return flops


def decoder_block_shapes(cfg) -> dict[str, tuple[int, int]]:
    """{LoRA target name: (d_in, d_out)} of one decoder block's linears (cfg: a
    `DecoderLMConfig`, explicit head_dim): GQA q, k, v, o and the SwiGLU FFN's gate, up, down."""
    d, q, kv, m = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_hidden
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, m), "up": (d, m), "down": (m, d)}


def decoder_block_linears(cfg) -> float:
    """One token through one decoder block's GQA projections and SwiGLU FFN (cfg: a `DecoderLMConfig`)."""
    return sum(linear(d_in, d_out) for d_in, d_out in decoder_block_shapes(cfg).values())


def lora(cfg) -> float:
    """One token through every LoRA factor of a `DecoderLMConfig`'s graft (0 without LoRA):
    per target of rank r, x (d_in) -> x A (r) -> x A B (d_out), on the blocks
    `graft.lora_layers` (else `graft.layers`) names."""
    graft = cfg.graft
    if graft.lora is None:
        return 0.0
    shapes, r = decoder_block_shapes(cfg), graft.lora.rank
    per_block = sum(linear(shapes[t][0], r) + linear(r, shapes[t][1]) for t in graft.lora.targets)
    return per_block * len(graft_layers(graft.lora_layers or graft.layers, cfg.n_layers))
