"""MoNe: a SwiGLU fast-weight memory in a pretrained decoder block, read as extra keys and values.

"MoNe: Modular Neural Memory" (paper 004), section 3 and appendix A.2. A row is cut into
segments of T tokens (token j: segment j // T, local position j mod T). For a grafted block
and segment s, with xn = RMSNorm(x) (B, T, dim) the block's normed input:

    q, k, v = the block's W_q, W_k, W_v (LoRA on them) of xn, RoPE at local positions (eq. 1, 3.3)
    h_j  = gate_j * RMSNorm_head(M(q~_j; W_{s-1}))                     (eq. 4: memory tokens)
    out  = Attn(q, [k || W_k h], [v || W_v h])                         (eq. 5)
    W_s  = W_{s-1} - mu_s, from l_j = -v~_j . M(k~_j; W_{s-1})          (eq. 7-8)

then x + W_o out and the block's own FFN. A token attends to the tokens of its segment up to
itself and to their memory tokens (each read from W_{s-1}, the memory written by earlier
segments): causal. The first segment reads W_0 (learned). The memory, its gradient
(explicit backward), the momentum step (`kernels.memory_update`) and the channel-wise
renormalisation are `models/memory/swiglu_memory.py`.

Around the memory (appendix A.2, following LaCT): q~ = L2(SiLU(q a_q + b_q)) per memory
head and k~ alike with its own affine (a, b per channel, init 1 and 0); v~ = SiLU(xn);
lr_j = softplus(xn_j w_lr + b_lr) per head; beta_s = sigmoid(mean_j(xn_j) w_beta + b_beta)
per head ("predicted from each chunk's hidden states"); gate_j = SiLU((q_j a_q + b_q) W_g)
per head. LoRA r128 / alpha 128 on W_q, W_k, W_v is `MONE_LORA` (the graft's `lora`).

Choices where the paper's shapes do not fit or it is silent (tested in tests/test_mone.py):
- Keys. W_k x has n_kv_heads * head_dim channels (128 at Qwen2.5-0.5B, GQA), the read
  queries W_q x n_heads * head_dim (896). The write keys are the attention's keys repeated
  per query head (as GQA compares them with queries), so writes and reads share one space
  of width n_heads * head_dim = H * in_h.
- Values. Eq. 6's v = W_v x (128 channels) cannot be the target of a memory whose output h is
  projected by W_k and W_v in eq. 5 (which needs h of width dim). The target is SiLU(xn),
  the block's normed input (width dim = H * out_h; the paper's "values SiLU only"): the
  memory returns hidden states, which W_k, W_v project as they project the tokens.
- Memory tokens: one per token (eq. 4), masked causally like the tokens; a full segment has
  T of them (the paper's "fixed size of T entries").
- Shapes: H = 4 heads, in_h = n_heads * head_dim / H, out_h = dim / H, hidden = in_h (the
  paper's "all three matrices d_h x d_h": 224 at Qwen2.5-0.5B). The "learned per-head gate"
  that is "SiLU-gated" is one in_h x out_h matrix per head. With learned W_0, the affines and
  the lr / beta projections that is 1.31M parameters per block: 31.3M over Qwen2.5-0.5B's 24
  blocks, 6.34 % of its 494M (the paper: 6.4 %).
- Segment-local RoPE applies to the segment's attention as well (tokens attend only inside
  their segment, where relative offsets are unchanged); query tokens of a new segment get
  positions from 0, the paper's [0, Q).
- Init: lr = softplus(b_lr) = `base_lr` (0.1) for every token, beta = 0.5 (b_beta = 0),
  W_0 columns N(0, 1/fan_in), the gate N(0, 1/in_h). Not the backbone at step 0: segment-local
  attention and the memory tokens change the block at once (the paper trains from there).
- Documents (the paper's query phase, section 3.4 and A.1): with doc positions (restarting
  at 0 per document) a segment starts at every document start, so it never spans two
  documents and a document's last segment may be short; that short segment is written
  (averaged over its own tokens) before the next document, which starts a new segment at
  local positions [0, Q). A task row [context | question] of two documents
  (`torchtitan_ext/data/task_data.py`, question="new_segment") is thus the paper's protocol: the
  question reads the memory tokens and itself, never a context token. The memory is not
  reset at document boundaries (as MemoryLlama). A stream ends its segment the same way
  (`end_segment`, `end_segments`). The row's trailing segment is read, not written.

Shapes: x (B, L, dim) -> (B, L, dim). `last_stats` holds the last forward's diagnostics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models.grafts.lora import LoRAConfig
from models.layers.flops import attention_span, FORWARD_ONLY, linear, TRAIN
from models.layers.graft_layers import graft_layers
from models.memory.swiglu_memory import column_norms, segment_write, swiglu_forward

MONE_LORA = LoRAConfig(rank=128, alpha=128.0, dropout=0.0, targets=("q", "k", "v"))  # appendix A.2


@dataclass
class MoNeConfig:
    heads: int = 4  # H fast-weight heads (appendix A.2)
    segment: int = 512  # T: tokens per memory write (appendix A.2)
    hidden: int | None = None  # SwiGLU hidden width per head; None: in_h (d_h x d_h as printed)
    base_lr: float = 0.1  # the per-token lr softplus(b_lr) at init
    kernel_backend: str = "auto"  # kernels.memory_update backend

    def __post_init__(self):
        if self.heads < 1 or self.segment < 1 or self.base_lr <= 0:
            raise ValueError(f"MoNe needs heads >= 1, segment >= 1 and base_lr > 0, got {self}")


def mone_flops(cfg, seq_len: int) -> tuple[float, float]:
    """What MoNe's blocks change per token of a `DecoderLMConfig` (its `graft`), in forward
    matmul FLOPs (models/layers/flops.py): (backbone, graft). The backbone's W_k, W_v project
    the memory tokens too, and each query attends over its segment's tokens and memory tokens
    (2T keys) in place of seq_len. The graft reads M (SwiGLU) and the gate per token, LoRA on
    W_k / W_v runs on the memory tokens too, and every full segment is written (M forward on k,
    the explicit gradient's four products); the last segment's write runs forward only when
    nothing reads it (seq_len a multiple of T), taken as its FORWARD_ONLY / TRAIN share."""
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


class MoNeCache(NamedTuple):
    """A block's stream state: the current segment's normed inputs xn (B, n, dim), its keys,
    values, memory keys and memory values (B, n_kv_heads, n, head_dim), and the fast weights
    and momenta (B, H, ...) written by the segments before it."""

    xn: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    memory_keys: torch.Tensor
    memory_values: torch.Tensor
    weights: tuple[torch.Tensor, ...]
    momentum: tuple[torch.Tensor, ...]


class MoNeBlock(nn.Module):
    """A backbone decoder block (its attention_norm, attention, ffn_norm, feed_forward kept
    under their names) whose attention also reads MoNe's memory tokens. The graft's own
    weights are named `memory*`."""

    def __init__(self, block: nn.Module, cfg: MoNeConfig):
        super().__init__()
        self.cfg = cfg
        self.attention_norm, self.attention = block.attention_norm, block.attention
        self.ffn_norm, self.feed_forward = block.ffn_norm, block.feed_forward
        attn = block.attention.cfg
        query_width = attn.n_heads * attn.head_dim
        if query_width % cfg.heads or attn.dim % cfg.heads:
            raise ValueError(f"MoNe heads {cfg.heads} must divide the query width {query_width} "
                             f"(n_heads * head_dim) and dim {attn.dim}")
        self.in_h, self.out_h = query_width // cfg.heads, attn.dim // cfg.heads
        hidden = cfg.hidden or self.in_h
        factory = dict(device=block.attention_norm.weight.device, dtype=block.attention_norm.weight.dtype)
        shapes = [(self.in_h, hidden), (self.in_h, hidden), (hidden, self.out_h)]  # W_in, W_gate, W_out
        self.memory_initial = nn.ParameterList(nn.Parameter(torch.empty(cfg.heads, *s, **factory)) for s in shapes)
        self.memory_query_affine = nn.Parameter(torch.empty(2, query_width, **factory))  # a_q, b_q
        self.memory_key_affine = nn.Parameter(torch.empty(2, query_width, **factory))  # a_k, b_k
        self.memory_gate = nn.Parameter(torch.empty(cfg.heads, self.in_h, self.out_h, **factory))  # W_g
        self.memory_lr = nn.Linear(attn.dim, cfg.heads, **factory)
        self.memory_decay = nn.Linear(attn.dim, cfg.heads, **factory)
        self.memory_norm = nn.RMSNorm(self.out_h, eps=1e-6, **factory)
        self.last_stats: dict[str, torch.Tensor] = {}
        self.reset_graft()

    def graft_parameters(self) -> list[nn.Parameter]:
        """What the graft adds (trains when the backbone is frozen)."""
        return [p for name, p in self.named_parameters() if name.startswith("memory")]

    def reset_graft(self) -> None:
        """The init of the module docstring."""
        with torch.no_grad():
            for w in [*self.memory_initial, self.memory_gate]:
                nn.init.normal_(w, std=w.shape[-2] ** -0.5)
            for affine in (self.memory_query_affine, self.memory_key_affine):
                affine[0].fill_(1.0)
                affine[1].zero_()
            for linear in (self.memory_lr, self.memory_decay):
                nn.init.normal_(linear.weight, std=0.02)
            nn.init.constant_(self.memory_lr.bias, math.log(math.expm1(self.cfg.base_lr)))  # softplus^-1
            nn.init.zeros_(self.memory_decay.bias)
            self.memory_norm.reset_parameters()

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, n, H * w) -> (B, H, n, w)."""
        return t.unflatten(-1, (self.cfg.heads, -1)).transpose(1, 2)

    @staticmethod
    def _affine(t: torch.Tensor, affine: torch.Tensor) -> torch.Tensor:
        """Attention heads t (B, n_heads, n, head_dim) -> (B, n, n_heads * head_dim) a + b."""
        return t.transpose(1, 2).flatten(-2) * affine[0] + affine[1]

    @staticmethod
    def state_dtype(activation_dtype: torch.dtype) -> torch.dtype:
        """Fast weights in float32 (float64 for float64 activations)."""
        return torch.float64 if activation_dtype == torch.float64 else torch.float32

    def empty_cache(self, batch: int, like: torch.Tensor) -> MoNeCache:
        """A new stream for activations like `like` (B, L, dim): W_0, zero momentum, no tokens."""
        dtype = self.state_dtype(like.dtype)
        weights = tuple(w.to(dtype).expand(batch, *w.shape) for w in self.memory_initial)
        attn = self.attention.cfg
        empty = like.new_zeros(batch, attn.n_kv_heads, 0, attn.head_dim)
        return MoNeCache(like.new_zeros(batch, 0, like.shape[-1]), empty, empty, empty, empty, weights,
                         tuple(torch.zeros_like(w) for w in weights))

    def _read(self, q_affine: torch.Tensor, weights) -> torch.Tensor:
        """Memory tokens h (B, n, dim) of eq. 4 from the affine queries (B, n, query width)."""
        heads = self._heads(q_affine)
        read, _ = swiglu_forward(weights, F.normalize(F.silu(heads), dim=-1).to(weights[0].dtype))
        h = self.memory_norm(read.to(q_affine.dtype)) * F.silu(heads @ self.memory_gate)
        return h.transpose(1, 2).flatten(-2)

    def _attend(self, q: torch.Tensor, cache: MoNeCache) -> torch.Tensor:
        """Eq. 5: q (B, n_heads, n, head_dim), the last n of the segment's tokens, over the
        segment's keys and memory keys, causally -> (B, n, dim). A segment never spans two
        documents, so no document mask is needed."""
        n_q, n_k = q.shape[2], cache.keys.shape[2]
        allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        keys = torch.cat([cache.keys, cache.memory_keys], 2)
        values = torch.cat([cache.values, cache.memory_values], 2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=torch.cat([allowed, allowed], -1),
                                             scale=self.attention.cfg.head_dim ** -0.5,
                                             enable_gqa=q.shape[1] != keys.shape[1])
        return self.attention.wo(out.transpose(1, 2).flatten(-2))

    def _write(self, cache: MoNeCache, targets, counts: torch.Tensor | None = None):
        """Eq. 7-8 from the segment in `cache`, columns renormalised to `targets` (W_0's norms
        in the state dtype) -> (the cache of an empty next segment, the segment's mean lr and
        beta, detached). The segment is complete, or a document's last one of n < T tokens:
        the loss is averaged over its own tokens (1/n where the paper's full segments have
        1/T). counts (B,): each row's number of real tokens at the segment's start, the rest
        padding that neither writes nor enters beta's mean; a row of 0 keeps its memory.
        None: every token is real."""
        attn = self.attention.cfg
        keys = cache.keys.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)
        dtype = cache.weights[0].dtype
        k = F.normalize(F.silu(self._heads(self._affine(keys, self.memory_key_affine))), dim=-1)
        v = F.silu(self._heads(cache.xn))
        lr = F.softplus(self.memory_lr(cache.xn)).transpose(1, 2)  # (B, H, n)
        size = cache.xn.shape[1]
        real = torch.ones(cache.xn.shape[:2], dtype=cache.xn.dtype, device=cache.xn.device) if counts is None else \
            (torch.arange(size, device=cache.xn.device) < counts[:, None]).to(cache.xn.dtype)  # (B, n)
        tokens = real.sum(1, keepdim=True).clamp_min(1)
        beta = torch.sigmoid(self.memory_decay((cache.xn * real[..., None]).sum(1) / tokens))
        weights, momentum = segment_write(cache.weights, cache.momentum, targets, k.to(dtype), v.to(dtype),
                                          (lr * (real * size / tokens)[:, None]).to(dtype), beta.to(dtype),
                                          self.cfg.kernel_backend)
        if counts is not None:
            kept = (counts > 0).view(-1, 1, 1, 1)
            weights = tuple(torch.where(kept, new, old) for new, old in zip(weights, cache.weights))
            momentum = tuple(torch.where(kept, new, old) for new, old in zip(momentum, cache.momentum))
        empty = cache.keys[:, :, :0]
        with torch.no_grad():
            stats = {"lr_mean": (lr * real[:, None]).sum() / (real.sum() * lr.shape[1]).clamp_min(1),
                     "beta_mean": beta.mean()}
        return MoNeCache(cache.xn[:, :0], empty, empty, empty, empty, weights, momentum), stats

    def _piece(self, x: torch.Tensor, cache: MoNeCache) -> tuple[torch.Tensor, MoNeCache]:
        """The next tokens x (B, n, dim) of the current segment (not past its end) -> (block
        output, the cache with them appended)."""
        start = cache.xn.shape[1]
        positions = torch.arange(start, start + x.shape[1], device=x.device).expand(x.shape[0], -1)
        xn = self.attention_norm(x)
        q, k, v = self.attention.project(xn, positions)
        memory_k, memory_v = self.attention.project_kv(self._read(self._affine(q, self.memory_query_affine),
                                                                  cache.weights), positions)
        cache = cache._replace(xn=torch.cat([cache.xn, xn], 1), keys=torch.cat([cache.keys, k], 2),
                               values=torch.cat([cache.values, v], 2),
                               memory_keys=torch.cat([cache.memory_keys, memory_k], 2),
                               memory_values=torch.cat([cache.memory_values, memory_v], 2))
        x = x + self._attend(q, cache)
        return x + self.feed_forward(self.ffn_norm(x)), cache

    def _targets(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The renormalisation targets (W_0's column norms) in the state dtype, once per call."""
        return tuple(n.to(dtype) for n in column_norms(self.memory_initial))

    def _record(self, stats: dict, start_weights, weights) -> None:
        """`last_stats`: the last write's lr and beta, and the call's update ratio."""
        with torch.no_grad():
            change = torch.stack([(a - b).float().norm() for a, b in zip(weights, start_weights)]).norm()
            stats["update_ratio"] = change / torch.stack([w.float().norm() for w in start_weights]).norm()
        self.last_stats = stats

    def _run(self, x: torch.Tensor, cache: MoNeCache):
        """x (B, L, dim) of one document per row, continuing `cache`, in pieces that end at
        segment boundaries (a segment is written once complete) -> (output, cache)."""
        start_weights, outputs, stats, start = cache.weights, [], {}, 0
        targets = self._targets(start_weights[0].dtype)
        while start < x.shape[1]:
            end = min(start + self.cfg.segment - cache.xn.shape[1], x.shape[1])
            out, cache = self._piece(x[:, start:end], cache)
            if cache.xn.shape[1] == self.cfg.segment:
                cache, stats = self._write(cache, targets)
            outputs.append(out)
            start = end
        self._record(stats, start_weights, cache.weights)
        return torch.cat(outputs, 1), cache

    def _run_documents(self, x: torch.Tensor, doc_positions: torch.Tensor) -> torch.Tensor:
        """Packed rows x (B, L, dim), doc_positions (B, L) restarting at 0 per document ->
        (B, L, dim). A segment starts at each document's start and every T tokens into a
        document (and at the row's first token), so it never spans two documents, and a
        document's last segment may be short. Row b's s-th segment fills slot s of a
        (B, S, T) grid, padded after its tokens; the slots run in lockstep. Every segment but
        the row's last is written, a short one too: a document after it (the paper's question,
        a new segment at positions [0, Q)) reads the context from the memory only."""
        batch, length, dim = x.shape
        size = self.cfg.segment
        index = torch.arange(length, device=x.device).expand(batch, -1)
        starts = doc_positions % size == 0
        starts[:, 0] = True
        segment = starts.cumsum(1) - 1  # (B, L) the token's segment in its row
        place = segment * size + index - torch.cummax(torch.where(starts, index, 0), 1).values  # (B, L) in the grid
        count = int(segment[:, -1].max()) + 1  # S
        counts = torch.zeros(batch, count, dtype=torch.long, device=x.device).scatter_add_(
            1, segment, torch.ones_like(segment))  # (B, S) tokens per segment
        grid = x.new_zeros(batch, count * size, dim).scatter(1, place[..., None].expand(-1, -1, dim), x)
        cache, outputs, stats = self.empty_cache(batch, x), [], {}
        start_weights, targets = cache.weights, self._targets(cache.weights[0].dtype)
        for s in range(count):
            out, cache = self._piece(grid[:, s * size:(s + 1) * size], cache)
            outputs.append(out)
            if s + 1 < count:
                cache, stats = self._write(cache, targets, counts[:, s])
        self._record(stats, start_weights, cache.weights)
        return torch.cat(outputs, 1).gather(1, place[..., None].expand(-1, -1, dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, doc_positions: torch.Tensor | None) -> torch.Tensor:
        """x (B, L, dim); positions (unused: RoPE is segment-local); doc_positions (B, L)
        restarting at 0 per document (`_run_documents`), or None: one document per row."""
        if doc_positions is None:
            return self._run(x, self.empty_cache(x.shape[0], x))[0]
        return self._run_documents(x, doc_positions)

    def step(self, x: torch.Tensor, positions: torch.Tensor, cache: MoNeCache | None):
        """The next tokens x (B, L, dim) of a stream (one document per row) -> (output, cache)."""
        return self._run(x, cache or self.empty_cache(x.shape[0], x))

    @staticmethod
    def keep_last(cache: MoNeCache, tokens: int) -> MoNeCache:
        """A bounded stream's cut (`DecoderLM.stream`): nothing to cut, the attention reaches
        no further back than the current segment (at most `segment` tokens)."""
        return cache

    def end_segment(self, cache: MoNeCache) -> MoNeCache:
        """A stream's document ends: its current segment, if it holds tokens, is written now
        (short: averaged over its own tokens) -> the cache of an empty segment, where the
        next document (the paper's question) starts at local position 0."""
        if cache.xn.shape[1] == 0:
            return cache
        return self._write(cache, self._targets(cache.weights[0].dtype))[0]


def end_segments(layers, state):
    """A DecoderLM stream's `state` (its `caches` one per block of `layers`, every one a
    MoNeBlock) with each block's current segment ended (`MoNeBlock.end_segment`): streaming
    the question from here equals reading [context | question] in one pass as two documents
    (doc positions restarting at the question), the paper's query phase."""
    layers = list(layers)
    if not all(isinstance(block, MoNeBlock) for block in layers):
        raise ValueError("only a model whose every block is MoNe can end its segments mid-stream")
    return state._replace(caches=tuple(block.end_segment(cache) for block, cache in zip(layers, state.caches)))
