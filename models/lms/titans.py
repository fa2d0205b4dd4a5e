"""Titans language models (Titans: Learning to Memorize at Test Time, arXiv:2501.00663, as
restated in the MemoryLlama thesis, section 2.3): decoder blocks, each with its own
neural memory (`models/memory/neural_memory.py`), in four variants:

- LMM: memory-only blocks   x += Memory(norm x);                     x += FFN(norm x)
- MAL: memory as a layer    x += Memory(norm x); x += SWA*(norm x);  x += FFN(norm x)   (eq. 2.42-2.44)
- MAG: memory as a gate     h = norm x; x += Gate(SWA*(h), Memory(h)); x += FFN(norm x) (eq. 2.45-2.47)
- MAC: memory as context, per segment s of `window` tokens, in the paper's order
  (eq. 2.48-2.51): r = M_{s-1}*(q) read with the segment's queries; y = Attn over
  [persistent; r; segment]; m = Memory(y) writes y (chunk by chunk) and reads the memory
  again; x_s += Gate(y, m).   Then x += FFN(norm x).
  `mac_write="inputs"` (an ablation, not the paper's) writes and reads the segment's normed
  inputs instead, m = Memory(norm x_s): the memory then binds token pairs as LMM's does, which
  separates the cost of writing attention outputs from the rest of the block (docs/leaderboard.md).

SWA* is sliding-window causal attention over `window` tokens with the persistent tokens
(learnable, `n_persistent`) prepended as keys/values visible to every query. In MAC a
query at segment position i sees the persistent tokens, retrieved tokens r_j and segment
tokens j for j <= i only (r_j carries token j's query, so a later r_j would leak).

Choices where the paper is silent (documented and tested):
- Gate(y, m), the paper's non-linear gate (x) (`gate="paper"`, default): both branches
  RMS-normalised with learnable vectors, then norm(y) * sigmoid(norm(m)), as the Titans
  paper describes its MAG gate; MAC "reuses the gated design of MAG" (thesis,
  eq. 2.51), so it takes the same gate. `gate="convex"` keeps the earlier
  g * y + (1 - g) * m with g = sigmoid(W_g y + b_g) per channel, b_g = 0.
- RoPE on queries and sequence keys (retrieved tokens take their token's position);
  persistent keys are not rotated.
- Each row is one stream: attention windows and memory run across packed-document
  boundaries (the memory state is not reset at BOS). `positions` is accepted for
  torchtitan's call signature and ignored.
- Streaming (`TitansLM.stream`): each block carries its memory state and its last
  `window` normed attention inputs (MAG, MAL) and the token count (RoPE positions stay
  absolute: persistent keys are not rotated, so scores depend on absolute positions) from
  call to call, so a long text read in segments gives the one-pass outputs in constant
  memory. MAC segments restart at every call: MAC calls must be whole windows but the last.
- FFN is SwiGLU (Transformer++), norms are RMSNorm, embeddings untied.
- The memory options (`memory`, a NeuralMemoryConfig) keep their defaults unless set:
  depth 2, expansion 4, momentum and forget gate on, max lr 0.01, the per-token gate rule,
  q/k/v conv of kernel 4, SiLU on v, output norm and gate (the paper's choices).
Shapes: tokens (B, T) -> logits (B, T, vocab_size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import repeat
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.diagnostics import recording_on
from models.layers.attention import flex_block_mask, masked_attention
from models.layers.ffn import SwiGLU, swiglu_hidden
from models.memory.chunk_loop import MemoryState
from models.memory.neural_memory import NeuralMemory, NeuralMemoryConfig
from models.layers.rope import apply_rope, rope_angles
from models.layers.tracing import stacked

VARIANTS = ("mac", "mag", "mal", "lmm")
GATES = ("paper", "convex")
MAC_WRITES = ("attention", "inputs")


@dataclass
class TitansConfig:
    variant: str = "mac"
    vocab_size: int = 4096
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    window: int = 64  # sliding-window size; MAC segment length
    n_persistent: int = 4
    gate: str = "paper"  # MAC / MAG output gate: "paper" (normalised branches, non-linear gate) or "convex"
    mac_write: str = "attention"  # what MAC's memory writes: "attention" outputs y (eq. 2.50) or the segment's "inputs"
    # The memory's own options; dim / n_heads / head_dim are the model's (`block_memory`): leave them unset.
    memory: NeuralMemoryConfig = field(default_factory=lambda: NeuralMemoryConfig(chunk_size=16))
    rope_theta: float = 10000.0
    max_seq_len: int = 131072
    norm_eps: float = 1e-6
    ffn_hidden: int | None = None
    init_std: float = 0.02
    # Token embeddings N(0, embedding_std); None: 1.0 for the gated variants (MAC, MAG), init_std
    # for MAL and LMM. The paper states no init. Why: a gated block adds norm_y(y) * sigmoid(...),
    # an output of RMS about 0.5 whatever the weights, so 0.02 embeddings are a few percent of
    # the residual stream after the first block and recall stalled (MQAR, T 64, 4 pairs, width
    # 64, 2 layers: MAC 0.41 after 1,500 steps at 0.02, 0.99 after 1,000 at 1.0, torchtitan's
    # llama3 draws N(0, 1) too); LMM learned slower at 1.0 (0.06 vs 0.10-0.17 around step
    # 1,000), so the ungated variants keep init_std. docs/benchmarks.md "Initialisation and recall".
    embedding_std: float | None = None

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"Titans variant '{self.variant}' unknown: choose one of {VARIANTS}")
        if self.gate not in GATES:
            raise ValueError(f"Titans gate '{self.gate}' unknown: choose one of {GATES}")
        if self.mac_write not in MAC_WRITES:
            raise ValueError(f"Titans mac_write '{self.mac_write}' unknown: choose one of {MAC_WRITES}")
        if self.mac_write != "attention" and self.variant != "mac":
            raise ValueError(f"mac_write '{self.mac_write}' applies to MAC only, not {self.variant}: leave it 'attention'")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} must divide by n_heads {self.n_heads}")
        self.ffn_hidden = self.ffn_hidden or swiglu_hidden(self.dim)
        self.block_memory  # a conflicting memory.dim / n_heads / head_dim ends here

    @property
    def token_embedding_std(self) -> float:
        """The std of the token embeddings (`embedding_std`, or its default by variant)."""
        if self.embedding_std is not None:
            return self.embedding_std
        return 1.0 if self.variant in ("mac", "mag") else self.init_std

    @property
    def block_memory(self) -> NeuralMemoryConfig:
        """The memory each block builds: `memory` with the model's width and heads."""
        return self.memory.filled_by("TitansConfig", dim=self.dim, n_heads=self.n_heads, head_dim=self.head_dim)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def stream_segment(self) -> int:
        """`TitansLM.stream` calls must be multiples of this (but the last): MAC's segment."""
        return self.window if self.variant == "mac" else 1


def prefix_window_mask(n_prefix: int, window: int, offset: int = 0):
    """Keys = [prefix; sequence]: every query sees the prefix, and sequence keys j with
    i - window < j <= i, where query q_idx is sequence position i = q_idx + offset (the
    sequence may start with `offset` earlier tokens that have no query)."""

    def mask_mod(q_idx, kv_idx):
        j, i = kv_idx - n_prefix, q_idx + offset
        return (kv_idx < n_prefix) | ((j <= i) & (i - j < window))

    return mask_mod


def mac_mask(n_prefix: int, segment: int):
    """Keys = [persistent; retrieved r_0..r_{S-1}; segment x_0..x_{S-1}]: query i sees the
    persistent tokens, r_j and x_j for j <= i."""

    def mask_mod(q_idx, kv_idx):
        j = kv_idx - n_prefix
        j = torch.where(j >= segment, j - segment, j)
        return (kv_idx < n_prefix) | (j <= q_idx)

    return mask_mod


class ConvexGate(nn.Module):
    """g * y + (1 - g) * m with g = sigmoid(W y + b) per channel (`gate="convex"`)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.last_gate = self.last_memory_part = None

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.proj.weight, std=std)
        nn.init.zeros_(self.proj.bias)

    def forward(self, y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(self.proj(y))
        if recording_on():
            self.last_gate, self.last_memory_part = g.detach(), ((1 - g) * m).detach()
        return g * y + (1 - g) * m


class NormGate(nn.Module):
    """The Titans paper's non-linear gate (`gate="paper"`; thesis eq. 2.47 / 2.51, o = y (x) M(x)):
    both branches RMS-normalised with learnable vectors, then o = norm_y(y) * sigmoid(norm_m(m)).
    The memory's part of o (diagnostics) is what the gate takes away: norm_y(y) * (1 - g)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.y_norm = nn.RMSNorm(dim, eps=eps)
        self.m_norm = nn.RMSNorm(dim, eps=eps)
        self.last_gate = self.last_memory_part = None

    def reset_parameters(self, std: float) -> None:
        self.y_norm.reset_parameters()
        self.m_norm.reset_parameters()

    def forward(self, y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(self.m_norm(m))
        normed = self.y_norm(y)
        if recording_on():
            self.last_gate, self.last_memory_part = g.detach(), (normed * (1 - g)).detach()
        return normed * g


class PersistentAttention(nn.Module):
    """Multi-head attention whose keys/values are [persistent tokens; given tokens]."""

    def __init__(self, cfg: TitansConfig):
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.persistent = nn.Parameter(torch.randn(cfg.n_persistent, cfg.dim) * cfg.init_std)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (self.cfg.n_heads, self.cfg.head_dim)).transpose(1, 2)

    def prefix_heads(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The persistent tokens' keys and values (batch, H, n_persistent, head_dim), not rotated."""
        k, v = (self._heads(linear(self.persistent)[None]).expand(batch, -1, -1, -1) for linear in (self.wk, self.wv))
        return k, v

    def forward(self, x: torch.Tensor, x_positions: torch.Tensor, kv: torch.Tensor, kv_positions: torch.Tensor, mask_mod):
        """x (B, Lq, dim) queries; kv (B, Lk, dim) keys/values after the persistent prefix;
        positions (Lq,), (Lk,) for RoPE."""
        hd, theta = self.cfg.head_dim, self.cfg.rope_theta
        q = apply_rope(self._heads(self.wq(x)), *rope_angles(x_positions[None], hd, theta))
        k = apply_rope(self._heads(self.wk(kv)), *rope_angles(kv_positions[None], hd, theta))
        prefix_k, prefix_v = self.prefix_heads(x.shape[0])
        k = torch.cat([prefix_k, k], 2)
        v = torch.cat([prefix_v, self._heads(self.wv(kv))], 2)
        out = masked_attention(q, k, v, mask_mod)
        return self.wo(out.transpose(1, 2).flatten(-2))


class TitansBlock(nn.Module):
    def __init__(self, cfg: TitansConfig):
        super().__init__()
        self.cfg = cfg
        self.memory_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.memory = NeuralMemory(cfg.block_memory)
        if cfg.variant != "lmm":
            self.attention = PersistentAttention(cfg)
        if cfg.variant == "mal":
            self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        if cfg.variant in ("mac", "mag"):
            self.gate = NormGate(cfg.dim, cfg.norm_eps) if cfg.gate == "paper" else ConvexGate(cfg.dim)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg.dim, cfg.ffn_hidden)
        self.last_memory_share: torch.Tensor | None = None

    def _window_attention(self, h: torch.Tensor, recent: torch.Tensor, seen: int):
        """Sliding-window attention of the new normed inputs h (B, T, d) over [recent; h],
        recent (B, p <= window, d) being the last inputs before them and `seen` the number
        of tokens before h (absolute RoPE positions: persistent keys are not rotated, so
        scores depend on the query's position). Returns the output (B, T, d) and the last
        `window` inputs for the next call."""
        keys = torch.cat([recent, h], 1)
        offset = recent.shape[1]
        positions = torch.arange(seen - offset, seen + h.shape[1], device=h.device)
        out = self.attention(h, positions[offset:], keys, positions,
                             prefix_window_mask(self.cfg.n_persistent, self.cfg.window, offset))
        return out, keys[:, -self.cfg.window :]

    def _note_share(self, memory_part: torch.Tensor | None, total: torch.Tensor) -> None:
        """||memory part|| / ||block update|| while diagnostics are recorded (`models.layers.diagnostics`;
        the gate records its part in the same forward then)."""
        if recording_on():
            self.last_memory_share = memory_part.detach().norm() / total.detach().norm().clamp_min(1e-12)

    def _mac(self, x: torch.Tensor, state: MemoryState | None, seen: int):
        """MAC over the segments of x (B, T, dim) from `state` (None: fresh) after `seen` tokens
        -> (x + Gate(y, m) (B, T, dim), new memory state). The same function as `_mac_per_segment`
        (the module docstring's order, segment by segment), with everything that does not
        depend on the memory state hoisted out of the segment loop, so that each segment runs
        only the chain through the state: the read r = M_{s-1}*(q) (its queries, their conv and
        output gate computed for all segments at once), the keys and values of r, attention,
        the write's projections, and the write. Linear maps that follow each other in the
        chain act as one matrix (the same function; rounding differs): the read's output
        projection folds into the attention's key/value projections of r, and the attention's
        output projection into the memory's q/k/v and gate projections of y = W_o a. The
        attention output y, the second read's output and the gate run once over all segments.
        Block masks (flex attention, CUDA) are built once per segment length."""
        cfg, memory, attention = self.cfg, self.memory, self.attention
        (batch, length, _), segment, n_prefix = x.shape, cfg.window, cfg.n_persistent
        if state is None:
            state = memory.empty_state(batch, device=x.device, dtype=x.dtype)
        h = self.memory_norm(x)
        positions = torch.arange(seen, seen + length, device=x.device)
        cos, sin = rope_angles(positions[None], cfg.head_dim, cfg.rope_theta)
        q = apply_rope(attention._heads(attention.wq(h)), cos, sin)
        keys = apply_rope(attention._heads(attention.wk(h)), cos, sin)
        values = attention._heads(attention.wv(h))
        prefix_k, prefix_v = attention.prefix_heads(batch)
        # the read queries contiguous once (the read's bmm would copy each segment's slice of them)
        read_q = memory.read_queries(h, segment).to(state.weights[0].dtype).contiguous()
        read_gate = memory.output_gate(h)
        read_kv, _ = stacked((attention.wk, attention.wv))
        if memory.cfg.output_proj:
            read_kv = read_kv @ memory.out.weight
        write_weight, write_bias = stacked((memory.to_qkv, memory.to_gates))
        if cfg.mac_write == "attention":
            write_weight = write_weight @ attention.wo.weight
        else:
            written = F.linear(h, write_weight, write_bias)
        masks = {}
        attended, reads = [], []
        # each tensor cut into its segments once: one backward op joins their gradients (a slice per
        # segment would fill a zero tensor of the whole length and add it, per segment)
        segments = zip(*(t.split(segment, 2) for t in (q, keys, values, read_q, cos, sin)),
                       repeat(None) if read_gate is None else read_gate.split(segment, 2),
                       repeat(None) if cfg.mac_write == "attention" else written.split(segment, 1))
        for q_s, keys_s, values_s, read_q_s, cos_s, sin_s, read_gate_s, written_s in segments:
            size = q_s.shape[2]
            if size not in masks:
                mask_mod = mac_mask(n_prefix, size)
                masks[size] = mask_mod, flex_block_mask(mask_mod, size, n_prefix + 2 * size, x.device)
            r = memory.output_heads(memory.read(read_q_s, state), x.dtype, read_gate_s)
            r_keys, r_values = F.linear(r, read_kv).chunk(2, -1)
            k = torch.cat([prefix_k, apply_rope(attention._heads(r_keys), cos_s, sin_s), keys_s], 2)
            v = torch.cat([prefix_v, attention._heads(r_values), values_s], 2)
            a = masked_attention(q_s, k, v, masks[size][0], block_mask=masks[size][1])
            a = a.transpose(1, 2).flatten(-2)
            projected = F.linear(a, write_weight, write_bias) if cfg.mac_write == "attention" else written_s
            m, state = memory.write(*projected.split([memory.to_qkv.out_features, memory.to_gates.out_features], -1),
                                    state)
            attended.append(a)
            reads.append(m)
        y = attention.wo(torch.cat(attended, 1))
        m = memory._output(torch.cat(reads, 2), y if cfg.mac_write == "attention" else h)
        out = self.gate(y, m)
        self._note_share(self.gate.last_memory_part, out)
        return x + out, state

    def _mac_per_segment(self, x: torch.Tensor, state: MemoryState | None, seen: int):
        """`_mac`'s plain reference: each segment in the module docstring's order, every
        projection applied as written (tests check `_mac` against it)."""
        cfg, outputs = self.cfg, []
        for start in range(0, x.shape[1], cfg.window):
            segment = x[:, start : start + cfg.window]
            h = self.memory_norm(segment)
            if state is None:
                state = self.memory.empty_state(x.shape[0], device=x.device, dtype=x.dtype)
            retrieved = self.memory.retrieve(h, state)
            positions = torch.arange(seen + start, seen + start + segment.shape[1], device=x.device)
            y = self.attention(h, positions, torch.cat([retrieved, h], 1), torch.cat([positions, positions]),
                               mac_mask(cfg.n_persistent, segment.shape[1]))
            m, state = self.memory(y if cfg.mac_write == "attention" else h, state)
            outputs.append(segment + self.gate(y, m))
        return torch.cat(outputs, 1), state

    def step(self, x: torch.Tensor, state: BlockState | None = None):
        """x (B, T, dim) continuing the stream in `state` (None: fresh) -> (x', new state).
        MAC segments restart at each call, so MAC calls must be whole windows but the last."""
        variant = self.cfg.variant
        memory_state, recent, seen = state if state is not None else (None, x[:, :0], 0)
        if variant == "mac":
            x, memory_state = self._mac(x, memory_state, seen)
        elif variant == "mag":
            h = self.memory_norm(x)
            m, memory_state = self.memory(h, memory_state)
            attended, recent = self._window_attention(h, recent, seen)
            out = self.gate(attended, m)
            self._note_share(self.gate.last_memory_part, out)
            x = x + out
        else:
            m, memory_state = self.memory(self.memory_norm(x), memory_state)
            self._note_share(m, x)
            x = x + m
            if variant == "mal":
                attended, recent = self._window_attention(self.attention_norm(x), recent, seen)
                x = x + attended
        return x + self.feed_forward(self.ffn_norm(x)), BlockState(memory_state, recent, seen + x.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.step(x)[0]


class BlockState(NamedTuple):
    """A block's stream state: its memory's state, the last `window` normed attention
    inputs (MAG, MAL; empty otherwise), and the number of tokens seen (RoPE positions)."""

    memory: MemoryState
    recent: torch.Tensor
    seen: int


class TitansState(NamedTuple):
    """One BlockState per layer, and whether the last call ended on a MAC segment boundary."""

    layers: tuple
    on_boundary: bool = True


class TitansLM(nn.Module):
    """Titans decoder LM. Attribute names follow torchtitan's decoders (see MLPLM)."""

    _skip_lm_head: bool = False

    def __init__(self, cfg: TitansConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TitansBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.enable_weight_tying = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std, residual_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            nn.init.normal_(self.tok_embeddings.weight, std=self.cfg.token_embedding_std)
            nn.init.normal_(self.lm_head.weight, std=self.cfg.dim**-0.5)
            self.norm.reset_parameters()
            for block in self.layers.values():
                for module in block.modules():
                    if isinstance(module, nn.RMSNorm):
                        module.reset_parameters()
                block.memory.reset_parameters()
                ffn = block.feed_forward
                nn.init.normal_(ffn.w1.weight, std=std)
                nn.init.normal_(ffn.w3.weight, std=std)
                nn.init.normal_(ffn.w2.weight, std=residual_std)
                if hasattr(block, "attention"):
                    attn = block.attention
                    for linear in (attn.wq, attn.wk, attn.wv):
                        nn.init.normal_(linear.weight, std=std)
                    nn.init.normal_(attn.wo.weight, std=residual_std)
                    nn.init.normal_(attn.persistent, std=std)
                if hasattr(block, "gate"):
                    block.gate.reset_parameters(std)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, attention_masks: None = None) -> torch.Tensor:
        if attention_masks is not None:
            raise ValueError("TitansLM builds its own masks; pass attention_masks=None")
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.cfg.max_seq_len}")
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        h = self.norm(h)
        return h if self._skip_lm_head else self.lm_head(h)

    def stream(self, tokens: torch.Tensor, state: TitansState | None = None):
        """tokens (B, T) continuing the stream in `state` (None: fresh) -> (logits, new
        state); segment by segment equals one pass. MAC: every call but the last must be a
        multiple of `window` tokens (`cfg.stream_segment`)."""
        if state is not None and not state.on_boundary:
            raise ValueError(f"Titans MAC streams whole segments: every call but the last must be a multiple of "
                             f"window = {self.cfg.window} tokens")
        h = self.tok_embeddings(tokens)
        layers = state.layers if state is not None else (None,) * len(self.layers)
        new = []
        for block, block_state in zip(self.layers.values(), layers):
            h, block_state = block.step(h, block_state)
            new.append(block_state)
        h = self.norm(h)
        return (h if self._skip_lm_head else self.lm_head(h)), TitansState(
            tuple(new), tokens.shape[1] % self.cfg.stream_segment == 0)


def memory_diagnostics(model: nn.Module) -> dict[str, float]:
    """The thesis' diagnostics from the last forward recorded (`models.layers.diagnostics.recording`),
    per layer: gate mean/std/min/max (MAC, MAG), the memory's share of the block update
    (||memory part|| / ||update||), and the memory's own statistics (`NeuralMemory.last_stats`:
    fast-weight and momentum norms, update-to-weight ratio, theta / eta / alpha means). Works
    through wrappers (FSDP, AC, compile)."""
    metrics = {}
    for name, block in model.named_modules():
        if not isinstance(block, TitansBlock) or block.last_memory_share is None:
            continue
        layer = f"memory/layer{name.split('layers.')[-1].split('.')[0]}"
        if hasattr(block, "gate") and block.gate.last_gate is not None:
            g = block.gate.last_gate.float()
            metrics |= {f"{layer}/gate_mean": g.mean(), f"{layer}/gate_std": g.std(),
                        f"{layer}/gate_min": g.min(), f"{layer}/gate_max": g.max()}
        metrics[f"{layer}/memory_share"] = block.last_memory_share
        metrics |= {f"{layer}/{k}": v for k, v in block.memory.last_stats.items()}
    return {k: float(v) for k, v in metrics.items()}
