"""Training FLOPs per token of the plain-torch families, counting what runs (torchtitan's MFU).
Each family's function here is its registry entry's `flops_per_token`.

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

from models.backbones.decoder_lm import DecoderLMConfig
from models.grafts.graft import graft_layers
from models.grafts.memory_llama import memory_config
from models.lms.gradmem import GradMemLMConfig
from models.lms.mela import MelaConfig
from models.lms.mlp_lm import MLPLMConfig
from models.memory.neural_memory import NeuralMemoryConfig
from models.lms.titans import TitansConfig

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


def memory_mlp(cfg: NeuralMemoryConfig) -> float:
    """One input through the memory MLP of every head."""
    return cfg.n_heads * sum(linear(i, o) for i, o in cfg.layer_shapes())


def newton_schulz(rows: int, cols: int, steps: int) -> float:
    """Muon's iteration on one matrix: per step X X^T, A A and (bA + cA^2) X (r = min side)."""
    r, c = sorted((rows, cols))
    return steps * (2 * r * r * c + 2 * r**3 + 2 * r * r * c)


def neural_memory(cfg: NeuralMemoryConfig) -> float:
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


def titans(cfg: TitansConfig, seq_len: int) -> float:
    """Per token: each block's memory, attention (MAC: keys are the segment's retrieved
    tokens and inputs plus the persistent tokens; MAG/MAL: the window and the persistent
    tokens), gate and SwiGLU FFN; the output head."""
    d, memory = cfg.dim, cfg.memory
    block = neural_memory(memory) + 3 * linear(d, cfg.ffn_hidden)
    if cfg.variant == "mac":
        segment = min(seq_len, cfg.window)
        retrieve = linear(d, memory.n_heads * memory.head_dim) + 2 * memory.n_heads * memory.head_dim * \
            memory.conv_kernel + memory_mlp(memory) + linear(memory.n_heads * memory.head_dim, d)
        retrieve += linear(d, memory.n_heads) if memory.output_gate else 0
        block += retrieve + 6 * linear(d, d) + attention_span(d, cfg.n_persistent + 2 * segment)
    elif cfg.variant in ("mag", "mal"):
        block += 4 * linear(d, d) + attention_span(d, cfg.n_persistent + min(seq_len, cfg.window))
    if cfg.variant in ("mac", "mag") and cfg.gate == "convex":
        block += linear(d, d)
    return TRAIN * (cfg.n_layers * block + linear(d, cfg.vocab_size))


def mlp_lm(cfg: MLPLMConfig, seq_len: int) -> float:
    """Per token: GQA attention projections and span, two-layer FFN, output head."""
    d, kv = cfg.dim, (cfg.n_kv_heads or cfg.n_heads) * cfg.head_dim
    block = 2 * linear(d, d) + 2 * linear(d, kv) + attention_span(d, seq_len) + 2 * linear(d, cfg.ffn_dim)
    return TRAIN * (cfg.n_layers * block + linear(d, cfg.vocab_size))


def decoder_block_linears(cfg: DecoderLMConfig) -> float:
    """One token through one decoder block's GQA projections (explicit head_dim) and SwiGLU FFN."""
    d, q, kv = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return 2 * linear(d, q) + 2 * linear(d, kv) + 3 * linear(d, cfg.ffn_hidden)


def lora(cfg: DecoderLMConfig) -> float:
    """One token through every LoRA factor of the graft (0 without LoRA)."""
    graft = cfg.graft
    if graft.lora is None:
        return 0.0
    d, q, kv, r = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, graft.lora.rank
    shapes = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, cfg.ffn_hidden),
              "up": (d, cfg.ffn_hidden), "down": (cfg.ffn_hidden, d)}
    per_block = sum(linear(shapes[t][0], r) + linear(r, shapes[t][1]) for t in graft.lora.targets)
    return per_block * len(graft_layers(graft.lora_layers or graft.layers, cfg.n_layers))


def decoder_lm(cfg: DecoderLMConfig, seq_len: int) -> float:
    """Per token: the backbone's GQA projections (explicit head_dim) and span, SwiGLU FFN,
    output head, and what a graft adds: LoRA factors; a MemoryLlama block's memory (write,
    the read of m and the read of h), W_DP and W_g, its chunked attention attending over
    (seq_len + chunk) / 2 keys on average (what the chunk-by-chunk attention computes) in
    place of the block's seq_len; the last chunk's Newton-Schulz write runs forward only
    (no later chunk reads it); a MoNe block's (`mone`). A frozen backbone's matmuls count 2x
    their forward (the activations' gradient is still taken, the weights' is not), trained ones 3x."""
    d, q = cfg.dim, cfg.n_heads * cfg.head_dim
    graft, added = cfg.graft, lora(cfg)
    backbone = cfg.n_layers * (decoder_block_linears(cfg) + attention_span(q, seq_len)) + linear(d, cfg.vocab_size)
    if graft.kind == "memoryllama":
        memory = memory_config(d, graft.memory)
        read_h = linear(d, d) + memory_mlp(memory) + (linear(d, d) if memory.output_proj else 0)
        per_block = neural_memory(memory) + read_h + linear(2 * d, d) + linear(d, d)
        grafted = len(graft_layers(graft.layers, cfg.n_layers))
        added += grafted * per_block
        chunk = min(graft.memory.chunk_size, seq_len)
        backbone -= grafted * (attention_span(q, seq_len) - attention_span(q, (seq_len + chunk) / 2))
        if memory.newton_schulz_steps and seq_len % chunk == 0:  # nothing reads the last chunk's write: no backward
            last_write = memory.n_heads * sum(newton_schulz(i, o, memory.newton_schulz_steps)
                                              for i, o in memory.layer_shapes())
            added -= grafted * (TRAIN - FORWARD_ONLY) / TRAIN * last_write / seq_len
    if graft.kind == "mone":
        backbone_extra, mone_added = mone(cfg, seq_len)
        backbone += backbone_extra
        added += mone_added
    frozen = graft.kind != "none" and graft.train == "graft"
    return (FORWARD_AND_INPUT_GRAD if frozen else TRAIN) * backbone + TRAIN * added


def mone(cfg: DecoderLMConfig, seq_len: int) -> tuple[float, float]:
    """What MoNe's blocks change per token: (backbone matmuls, graft matmuls). The backbone's
    W_k, W_v project the memory tokens too, and each query attends over its segment's tokens
    and memory tokens (2T keys) in place of seq_len. The graft reads M (SwiGLU) and the gate
    per token, LoRA on W_k / W_v runs on the memory tokens too, and every full segment is
    written (M forward on k, the explicit gradient's four products); the last segment's write
    runs forward only when nothing reads it (seq_len a multiple of T)."""
    graft = cfg.graft
    d, q, kv = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    heads, segment = graft.memory.heads, min(graft.memory.segment, seq_len)
    in_h, out_h = q // heads, d // heads
    hidden = graft.memory.hidden or in_h
    swiglu = heads * (2 * linear(in_h, hidden) + linear(hidden, out_h))
    read = swiglu + heads * linear(in_h, out_h) + linear(d, heads)
    write = swiglu + heads * (2 * linear(hidden, out_h) + 2 * linear(in_h, hidden))
    full = seq_len // segment
    read_later = full if seq_len % segment else full - 1
    write_per_token = write * segment * (read_later + (full - read_later) * FORWARD_ONLY / TRAIN) / seq_len
    lora = graft.lora
    lora_on_memory = 0.0 if lora is None else sum(linear(d, lora.rank) + linear(lora.rank, kv)
                                                  for t in ("k", "v") if t in lora.targets)
    grafted = len(graft_layers(graft.layers, cfg.n_layers))
    backbone = grafted * (2 * linear(d, kv) + attention_span(q, 2 * segment) - attention_span(q, seq_len))
    return backbone, grafted * (read + write_per_token + lora_on_memory)


def mela(cfg: MelaConfig, seq_len: int) -> float:
    """Per text token. Decoder: every chunk of P*C text tokens runs with its C memory tokens
    (positions (P*C + C) / (P*C) per token), GQA attention over the chunk, SwiGLU, plus the
    diagnostic attention mass of the last 64 queries (forward only); output head. HMM (per
    patch, 1/P per token): patchify, then H cycles of L L-module steps and one H-module step,
    the first H-1 cycles forward only; each module step = input fusion MLP + its blocks
    (gated attention over the chunk's C patches, neural memory); the output fusions. Both
    memory chains run the same steps; with `memory_path=False` the HMM does not run."""
    d, m, p, c = cfg.dim, cfg.memory_dim, cfg.patch_size, cfg.chunk_size
    chunk = cfg.chunk_tokens + c
    kv = cfg.n_kv_heads * cfg.head_dim
    layer = 2 * linear(d, d) + 2 * linear(d, kv) + attention_span(d, chunk) + 3 * linear(d, cfg.ffn_hidden)
    decoder = TRAIN * cfg.n_layers * layer * chunk / cfg.chunk_tokens
    decoder += FORWARD_ONLY * cfg.n_layers * 2 * min(64, chunk) * chunk * d / cfg.chunk_tokens
    decoder += TRAIN * linear(d, cfg.vocab_size)

    memory_kv = cfg.memory_kv_heads * (m // cfg.memory_heads)
    block = 0.0
    if cfg.memory_attention:
        block += 2 * linear(m, m) + 2 * linear(m, memory_kv) + attention_span(m, c)
        block += linear(m, m) if cfg.attention_gating else 0
    if cfg.neural_memory:
        block += neural_memory(cfg.memory)
    fusion_in = linear(2 * m, m) + linear(m, m)
    l_step, h_step = fusion_in + cfg.l_layers * block, fusion_in + cfg.h_layers * block
    cycle = cfg.l_cycles * l_step + h_step
    output_fusion = linear(2 * m, m) + linear(m, d) if cfg.fusion == "mlp" else (linear(m, d) if m != d else 0)
    fusions = cfg.h_cycles if cfg.memstack else 1
    hmm_per_patch = FORWARD_ONLY * (cfg.h_cycles - 1) * cycle + TRAIN * (cycle + fusions * output_fusion)
    hmm_per_patch += TRAIN * linear(m * p, m)  # patchify: a stride-P conv over P tokens
    hmm = hmm_per_patch / p + (TRAIN * linear(d, m) if m != d else 0)
    return decoder + (hmm if cfg.memory_path else 0.0)


def training_flops_per_token(config, seq_len: int, n_params: int) -> float:
    """Training FLOPs per token of a plain model config: its family's count
    (`Family.flops_per_token`), or the dense 6 x parameters where the family has none."""
    from torchtitan_ext.families import family_of_config

    count = family_of_config(config).flops_per_token
    return count(config, seq_len) if count else 6.0 * n_params


def gradmem(cfg: GradMemLMConfig, seq_len: int) -> float:
    """Per token of a GradMem row of seq_len tokens, taken as all context (`gradmem_row` with
    no read tokens: a KV row's query and answer are 9 of its 7n + 9 tokens)."""
    return gradmem_row(cfg, seq_len, 0)


def gradmem_row(cfg: GradMemLMConfig, context: int, read: int) -> float:
    """Per token of a row of `context` + `read` tokens: K WRITE steps over the context, the
    read over [M; read tokens], the head over the row. Per token through the backbone: linears
    `lin`, LoRA `lora`, attention over a span S `att(S)`, the head `head`; in a backward a
    trained linear counts 2 (activations and weights), a frozen one 1, attention 2.
    Gradient WRITE, per step over T = m + c tokens (c of them through the heads): the forward
    (1), the inner gradient w.r.t. the memory (activations only: 1 per linear and head, 2 per
    attention) and the outer backward through both (the forward's: 2 / 1 per linear, 2 per
    attention; the inner gradient's double backward, each of its products differentiated in
    both inputs: 2 / 1 per linear, 4 per attention); the WRITE head's Delta is trained.
    First-order writes (`meta_gradient` "first" / "none"): each step is the forward and the
    inner gradient only, and the outer backward runs through the last step's forward alone
    (the write-loss term; no double backward).
    Forward WRITE, per step over [M; C; M] (2m + c tokens): a trained forward + backward.
    The read trains as a plain step over its m + r tokens. The optional memory projection P
    (m x d x d per write, off in the KV runs) is not counted."""
    m, steps = cfg.gradmem.n_mem, cfg.gradmem.write_steps
    q = cfg.n_heads * cfg.head_dim
    trained = 2 if cfg.train_backbone else 1  # backward products of a backbone linear
    lin, adapters, head = cfg.n_layers * decoder_block_linears(cfg), lora(cfg), linear(cfg.dim, cfg.vocab_size)

    def att(span: float) -> float:
        return cfg.n_layers * attention_span(q, span)

    def plain_step(span: float) -> float:
        return (1 + trained) * lin + TRAIN * (adapters + att(span))

    if cfg.gradmem.write == "gradient":
        span = m + context
        write_head = head if cfg.gradmem.write_head else 0.0
        if cfg.gradmem.meta_gradient == "second":
            per_step = span * ((2 + 2 * trained) * lin + 6 * adapters + 9 * att(span)) + \
                context * ((2 + 2 * trained) * head + 6 * write_head)
        else:
            write_and_gradient = span * (2 * lin + 2 * adapters + 3 * att(span)) + context * (2 * head + 2 * write_head)
            last_backward = span * (trained * lin + 2 * adapters + 2 * att(span)) + context * (trained * head + 2 * write_head)
            per_step = write_and_gradient + last_backward / steps
    else:
        span = 2 * m + context
        per_step = span * plain_step(span)
    row = context + read
    return (steps * per_step + (m + read) * plain_step(m + read)) / row + (1 + trained) * head
