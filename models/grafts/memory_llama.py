"""MemoryLlama: a Titans neural memory grafted into a pretrained decoder block.

"Neural memory augmentation for LLMs" (MemoryLlama thesis), section 4.1.3, eq. 4.1-4.10.
For the tokens t of a block input x (B, L, dim):

    q_t  = x_t W_q                                h_t = M_{t-1}*(q_t)          (4.1-4.2)
    x_DP = [RMSNorm(x_t), h_t] W_DP,  W_DP = [W_x; W_h]                         (4.3-4.4)
    a_t  = Attn(x_DP)                             (the backbone's attention, W_o included; 4.5)
    M_t  = Update(M_{t-1}; a_t)                   m_t = M_t*(a_t)              (4.6-4.7)
    g_t  = sigmoid(a_t W_g + b_g)                 y_t = (1 - g_t) a_t + g_t m_t (4.8-4.9)
    o_t  = x_t + y_t                                                            (4.10, see below)

then the block's own RMSNorm + SwiGLU + residual on o. Eq. 4.10 is printed o_t = y_t + x_DP:
that replaces the residual stream by x_DP (= RMSNorm(x_t) at init), so the block could not
"behave identically to the original layer" at init as section 4.1.3 requires (measured on
main before this fix: the debug Qwen3's step-0 logits moved by 109% relative), and the
thesis' public code (github.com/RPegoud/Hercules, hercules/memory_llama.py,
LlamaMemoryAsContext) adds the hidden states: `residual_attn = memory_augmented_attn +
hidden_states`. Here o_t = x_t + y_t under both inits.

The memory is `models/memory/neural_memory.py` with one head of width dim: q / k SiLU + L2,
SiLU v (as the public code), theta = 0.01 sigmoid(.), momentum and forgetting (eq. 2.38-2.40,
the loss summed over features as printed), no conv, output norm or output gate; its MLP has
`depth` matrices of hidden width 2 dim (section 4.2.1: "two-layer MLPs with residual
connections and an expansion factor of two"; appendix B: mlp_depth 3), with `residual` one
skip around them, M(x) = x + MLP(x). The public code's memory network meant a skip per layer
(x W + x P, P = I where square, a learned random matrix otherwise), but it builds P from an
already consumed `zip`: it has no layers to run and returns its input (M(x) = x, nothing
written), so its form is not copied.

`THESIS_MEMORY` is the thesis' block as printed and as run (appendix B): its init, Titans'
rule token by token, m_t read after token t's write, a depth-3 residual memory, the query from
x_t, the write on a_t, no output projection. Its memory module (memory MLP, q / k / v, the
theta / eta / alpha gates) has 11 dim^2 + 3 dim + 3 parameters, 46.1M at Llama-3.2-1B's dim
2048: the thesis' "approximately 46 million" "including its gating layers and q, k, v
projections", which the public code's module matches (its unused 8 dim^2 MLP included); W_DP
and W_g add 3 dim^2 + dim (12.6M) per block (tests/test_memory_llama.py).

The default (`MemoryLlamaConfig()`) departs from the printed equations where they were
measured not to train; each departure is an option whose other value is the thesis'
(tests/test_memory_llama.py checks THESIS_MEMORY and mixes of both values of every option,
under Titans' rule, against an independent per-token reference of eq. 4.1-4.10; the "muon"
write is NeuralMemory's, tested in tests/test_neural_memory.py):
- Chunked (`chunk_size` C, `read_after_write` False). h_t reads the memory written from the
  attention outputs of earlier tokens, whose attention read earlier h: the block is
  sequential. It runs chunk by chunk: chunk c reads M_{c-1} for both h and m, attends over
  the keys / values of every earlier chunk (a cache) and itself, then writes M_c from its a.
  Eq. 4.7's m_t = M_t*(a_t) (`read_after_write`) is causal only token by token: it needs C = 1.
- The write rule (`update`). "titans" is eq. 2.39-2.40 (Titans' per-token momentum and
  forgetting; inside a chunk every token's gradient is taken at the chunk-start weights);
  with C = 1 it is the thesis' token-by-token rule, which is stable (theta <= 0.01) but runs
  L sequential steps per block. With C > 1 it is not stable: the attention outputs of a
  chunk are alike, their C gradients add up, and with momentum the step exceeds the
  curvature's limit (measured on the 4-block debug Qwen3, random-token batches, AdamW: at
  lr 1e-2 and 3e-3 the loss was NaN within 10 and 41 steps, the fast weights growing from 20
  to 3e3 to 7e7 over three chunks). "muon" (default) writes one step per chunk,
  orthogonalised by Newton-Schulz and scaled by `step_scale` (Mela's eq. 10-11 with its
  learning rate, models/lms/mela.py): the step's size no longer depends on the gradients',
  and the same runs went 60 steps without a NaN. Its cost is Newton-Schulz on the single
  dim x 2 dim head once per chunk, 10 dim^3 / C per token and step: at dim 2048 choose C in
  the hundreds (train_configs/backbone.py).
- `query_norm` (default True): eq. 4.1's query is taken from RMSNorm(x_t), the vector it is
  concatenated with, not from the raw residual stream (whose scale grows with depth; SiLU
  before the L2 norm is not scale-invariant). False: from x_t, as printed and as the public
  code (`retrieve(hidden_states)`).
- `write_norm` (default True): the memory writes and reads RMSNorm(a_t) (a learned-weight
  RMSNorm, `memory_norm`), not a_t: a_t's scale is unbounded, and on raw a_t a debug
  finetune (lr 1e-2) diverged within 10 steps: large a_t saturate theta at max_lr and eta at
  1 and enlarge the values, the fast weights grew from 37 to 1.2e4 in one chunk, and h fed
  the growth back into a_t through x_DP. False: a_t, as printed.
- `output_proj` (default True): the memory's read goes through a dim x dim projection (the
  Titans layer's); False: M*(.) itself, as eq. 4.2 / 4.7 and the public code.
- The memory state is not reset at packed-document boundaries (as in the project's Titans);
  attention is document-masked as in the backbone.
- Two inits (`init`):
  * "exact" (default): the block computes the backbone's block at step 0 (every graft term
    is multiplied by a zero), and every change is a learned departure from it:
    x_DP = RMSNorm(x) + [RMSNorm(x), h] W_DP with W_DP = 0 (the thesis' W_x = I, W_h = 0,
    written as a delta so that weight decay pulls towards the identity rather than towards
    zero); y = a + s * g * (m - a) with a per-channel gate scale s = 0 (so g's values are
    free at init: W_g = 0, b_g = 0). s receives gradient at the first step, W_DP at the first
    (through the attention), W_g / b_g and the memory's projections from the second. In
    float32 the chunked attention and projections may round differently from the
    backbone's full-sequence kernels: 0 difference at the unit tests' shapes, up to 6e-7 on
    logits at others (CPU), the same first loss through torchtitan.
  * "thesis": W_x = I, W_h = 0, W_g = 0, b_g = -6 (section 4.1.3). x_DP = RMSNorm(x) at
    init, so the block departs from the backbone's only by g (m - a) with g = sigmoid(-6) =
    2.5e-3 (the thesis' eq. 4.11, y ~ a): on the random-weight debug Qwen3 with ALMA and
    THESIS_MEMORY, 2 x 256 tokens, the step-0 logits move by 0.40-0.49% relative
    (||delta|| / ||logits||, 3 seeds; 109% with the printed o = y + x_DP; test: at most 2%).

Shapes: x (B, L, dim) -> (B, L, dim). `last_stats` holds the thesis' monitoring (section
4.2.2) of the last forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.layers.flops import (attention_span, FORWARD_ONLY, linear, memory_mlp, neural_memory, newton_schulz,
                                 TRAIN)
from models.layers.decoder import DecoderBlock
from models.layers.graft_layers import graft_layers
from models.memory.neural_memory import NeuralMemory, NeuralMemoryConfig

INITS = ("exact", "thesis")
UPDATES = ("muon", "titans")
THESIS_GATE_BIAS = -6.0
CONTRIBUTION_EPS = 1e-6


@dataclass
class MemoryLlamaConfig:
    init: str = "exact"  # "exact": the backbone's block at step 0; "thesis": the thesis' printed values
    update: str = "muon"  # "muon": one Newton-Schulz step per chunk; "titans": eq. 2.39-2.40 per token
    chunk_size: int = 64  # tokens per sequential step (1 with update "titans": the thesis' token-by-token rule)
    step_scale: float = 0.1  # update "muon": M = (1 - alpha) M + step_scale NewtonSchulz(S)
    expansion: int = 2  # memory MLP hidden width = expansion * dim (thesis: 2)
    depth: int = 2  # memory MLP matrices (section 4.2.1: 2; appendix B: mlp_depth 3)
    residual: bool = False  # memory MLP M(x) = x + MLP(x) (sections 2.3, 4.2.1)
    max_lr: float = 0.01  # theta = max_lr * sigmoid(.) (thesis: 1e-2)
    query_norm: bool = True  # eq. 4.1's query from RMSNorm(x_t); False: from x_t (as printed)
    write_norm: bool = True  # the memory writes / reads RMSNorm(a_t); False: a_t (as printed)
    read_after_write: bool = False  # m_t = M_t*(a_t) after token t's write (eq. 4.7 as printed; chunk_size 1)
    output_proj: bool = True  # a dim x dim projection after the memory's read; False: M*(.) (as printed)

    def __post_init__(self):
        if self.init not in INITS:
            raise ValueError(f"MemoryLlama init '{self.init}' unknown: choose one of {INITS}")
        if self.update not in UPDATES:
            raise ValueError(f"MemoryLlama update '{self.update}' unknown: choose one of {UPDATES}")
        if self.chunk_size < 1 or self.depth < 1:
            raise ValueError(f"MemoryLlama chunk_size and depth must be >= 1, got {self.chunk_size} and {self.depth}")
        if self.read_after_write and self.chunk_size != 1:
            raise ValueError(f"MemoryLlama read_after_write reads M_t after token t's write, causal only token by "
                             f"token: set chunk_size 1 (got {self.chunk_size}) or read_after_write False")


# The thesis' block as printed and run (module docstring).
THESIS_MEMORY = dict(init="thesis", update="titans", chunk_size=1, depth=3, residual=True, query_norm=False,
                     write_norm=False, read_after_write=True, output_proj=False)


def memory_config(dim: int, cfg: MemoryLlamaConfig) -> NeuralMemoryConfig:
    """The thesis' memory for a block of width `dim` (module docstring), without the Titans
    memory's default surprise bound (`max_update_norm` 0): the thesis has none, and its
    memories are one head of the model's width, where the bound's calibration (heads of 32-64)
    does not carry."""
    rule = dict(gates="chunk", newton_schulz_steps=5, step_scale=cfg.step_scale) if cfg.update == "muon" else {}
    return NeuralMemoryConfig(dim=dim, n_heads=1, head_dim=dim, depth=cfg.depth, expansion=cfg.expansion,
                              residual=cfg.residual, chunk_size=cfg.chunk_size, conv_kernel=0, output_norm=False,
                              output_gate=False, output_proj=cfg.output_proj, read_after_write=cfg.read_after_write,
                              max_lr=cfg.max_lr, max_update_norm=0.0, **rule)


def memory_llama_flops(cfg, seq_len: int) -> tuple[float, float]:
    """What MemoryLlama's blocks change per token of a `DecoderLMConfig` (its `graft`), in
    forward matmul FLOPs (models/layers/flops.py): (backbone, graft). Per grafted block the
    graft adds the memory's write (`neural_memory`), the read of h (W_q, M, the output
    projection when on), the read of m and W_DP, W_g; the backbone's attention attends over
    (seq_len + C) / 2 keys on average (what the chunk-by-chunk attention computes) in place of
    seq_len. The last chunk's Newton-Schulz write runs forward only (no later chunk reads it),
    taken off as its share (TRAIN - FORWARD_ONLY) / TRAIN of the graft's trained count."""
    graft, d, q = cfg.graft, cfg.dim, cfg.n_heads * cfg.head_dim
    memory = memory_config(d, graft.memory)
    read_h = linear(d, d) + memory_mlp(memory) + (linear(d, d) if memory.output_proj else 0)
    per_block = neural_memory(memory) + read_h + linear(2 * d, d) + linear(d, d)
    grafted = len(graft_layers(graft.layers, cfg.n_layers))
    added = grafted * per_block
    chunk = min(graft.memory.chunk_size, seq_len)
    backbone = -grafted * (attention_span(q, seq_len) - attention_span(q, (seq_len + chunk) / 2))
    if memory.newton_schulz_steps and seq_len % chunk == 0:  # nothing reads the last chunk's write: no backward
        last_write = memory.n_heads * sum(newton_schulz(i, o, memory.newton_schulz_steps)
                                          for i, o in memory.layer_shapes())
        added -= grafted * (TRAIN - FORWARD_ONLY) / TRAIN * last_write / seq_len
    return backbone, added


class MemoryLlamaBlock(nn.Module):
    """A backbone decoder block (its attention_norm, attention, ffn_norm, feed_forward kept
    under their names, so checkpoints and LoRA targets are unchanged) with a neural memory
    around its attention. The graft's own weights are named `memory*`."""

    def __init__(self, block: nn.Module, dim: int, cfg: MemoryLlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.attention_norm, self.attention = block.attention_norm, block.attention
        self.ffn_norm, self.feed_forward = block.ffn_norm, block.feed_forward
        factory = dict(device=block.attention_norm.weight.device, dtype=block.attention_norm.weight.dtype)
        with torch.device(factory["device"]):
            self.memory = NeuralMemory(memory_config(dim, cfg)).to(factory["dtype"])
        # on a_t before the memory (`write_norm`, module docstring)
        self.memory_norm = nn.RMSNorm(dim, eps=1e-6, **factory) if cfg.write_norm else nn.Identity()
        self.memory_down_proj = nn.Linear(2 * dim, dim, bias=False, **factory)  # W_DP = [W_x; W_h]
        self.memory_gate = nn.Linear(dim, dim, **factory)  # W_g, b_g
        if cfg.init == "exact":
            self.memory_gate_scale = nn.Parameter(torch.zeros(dim, **factory))
        self.last_stats: dict[str, torch.Tensor] = {}
        self.reset_graft()

    def graft_parameters(self) -> list[nn.Parameter]:
        """What the graft adds (trains when the backbone is frozen)."""
        return [p for name, p in self.named_parameters() if name.startswith("memory")]

    def reset_graft(self) -> None:
        """The chosen init's values (module docstring)."""
        dim = self.memory_gate.in_features
        with torch.no_grad():
            self.memory.reset_parameters()
            if self.cfg.write_norm:
                self.memory_norm.reset_parameters()
            nn.init.zeros_(self.memory_gate.weight)
            if self.cfg.init == "exact":
                nn.init.zeros_(self.memory_down_proj.weight)
                nn.init.zeros_(self.memory_gate.bias)
                nn.init.zeros_(self.memory_gate_scale)
            else:
                identity = torch.eye(dim, device=self.memory_gate.weight.device)
                self.memory_down_proj.weight.copy_(torch.cat([identity, torch.zeros_like(identity)], 1))
                nn.init.constant_(self.memory_gate.bias, THESIS_GATE_BIAS)

    def _down_project(self, xn: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Eq. 4.3-4.4: x_DP from RMSNorm(x) and h, (B, C, dim) each."""
        x_dp = self.memory_down_proj(torch.cat([xn, h], -1))
        return xn + x_dp if self.cfg.init == "exact" else x_dp

    def _attend_with_memory(self, x: torch.Tensor, xn: torch.Tensor, positions: torch.Tensor,
                            doc_positions: torch.Tensor | None, cache: tuple | None = None):
        """The sequential part, chunk by chunk: h, x_DP, attention over the cache, the memory
        write and read. x and xn = RMSNorm(x) (B, L, dim) -> a, m (B, L, dim) each, and the
        cache after them: (keys, values (B, n_kv_heads, S, head_dim), MemoryState, tokens seen),
        S = seen + L unless a bounded stream cut the keys (`keep_last`). `cache` continues a
        stream (chunks stay aligned to the stream's multiples of chunk_size, counted in tokens
        seen, a Python int: no read of a device tensor)."""
        keys, values, state, seen = cache or (None, None, self.memory.empty_state(xn.shape[0], device=xn.device,
                                                                                  dtype=xn.dtype), 0)
        queries = xn if self.cfg.query_norm else x  # eq. 4.1's input (module docstring)
        size, attended, reads = self.cfg.chunk_size, [], []
        start = 0
        while start < xn.shape[1]:
            end = min(start + size - (seen + start) % size, xn.shape[1])
            x_dp = self._down_project(xn[:, start:end], self.memory.retrieve(queries[:, start:end], state))
            q, k, v = self.attention.project(x_dp, positions[:, start:end])
            keys = k if keys is None else torch.cat([keys, k], 2)
            values = v if values is None else torch.cat([values, v], 2)
            a = self.attention.attend(q, keys, values, None if doc_positions is None else doc_positions[:, :end])
            m, state = self.memory(self.memory_norm(a), state)  # eq. 4.6-4.7
            attended.append(a)
            reads.append(m)
            start = end
        return torch.cat(attended, 1), torch.cat(reads, 1), (keys, values, state, seen + xn.shape[1])

    def _block(self, x: torch.Tensor, positions: torch.Tensor, doc_positions: torch.Tensor | None, cache):
        """The whole block (eq. 4.1-4.10, then the FFN): (output, cache after x)."""
        a, m, new_cache = self._attend_with_memory(x, self.attention_norm(x), positions, doc_positions, cache)
        gate = torch.sigmoid(self.memory_gate(a))  # eq. 4.8
        if self.cfg.init == "exact":
            gate = self.memory_gate_scale * gate
            y = a + gate * (m - a)  # eq. 4.9 as a + g (m - a)
        else:
            y = (1 - gate) * a + gate * m  # eq. 4.9
        o = x + y  # eq. 4.10 with the residual stream x (module docstring)
        self._note_stats(gate, a, m)
        return o + self.feed_forward(self.ffn_norm(o)), new_cache

    def forward(self, x: torch.Tensor, positions: torch.Tensor, doc_positions: torch.Tensor | None) -> torch.Tensor:
        """x (B, L, dim); positions (B, L) for RoPE; doc_positions (B, L) or None for masking."""
        return self._block(x, positions, doc_positions, None)[0]

    def step(self, x: torch.Tensor, positions: torch.Tensor, cache: tuple | None):
        """The next tokens of a stream (one document per row; `DecoderLM.stream`): x (B, L,
        dim), positions (B, L) continuing the stream's -> (output, cache)."""
        return self._block(x, positions, None, cache)

    @staticmethod
    def keep_last(cache: tuple, tokens: int) -> tuple:
        """A stream's cache (keys, values, MemoryState, tokens seen) with keys and values cut to
        their last `tokens` tokens; the memory state whole."""
        keys, values, state, seen = cache
        return (*DecoderBlock.keep_last((keys, values), tokens), state, seen)

    def _note_stats(self, gate: torch.Tensor, a: torch.Tensor, m: torch.Tensor) -> None:
        """The thesis' monitoring (section 4.2.2), detached: gate mean/std/min/max (the
        effective gate s * g under the exact init), mean b_g, ||W_h|| (the memory half
        of W_DP, Frobenius norm), the global contribution (eq. 4.12) and the mean per-token
        contribution (eq. 4.13), with the norms taken over channels (and tokens for 4.12)."""
        with torch.no_grad():
            g = gate.float()
            memory_part, attention_part = (m.float() * g), ((1 - g) * a.float())
            per_token = memory_part.norm(dim=-1) / (attention_part.norm(dim=-1) + CONTRIBUTION_EPS)
            w_h = self.memory_down_proj.weight[:, self.memory_gate.in_features:].float()
            self.last_stats = {
                "gate_mean": g.mean(), "gate_std": g.std(), "gate_min": g.min(), "gate_max": g.max(),
                "gate_bias": self.memory_gate.bias.float().mean(),
                "w_h_norm": w_h.norm(),
                "contribution_global": memory_part.norm() / (attention_part.norm() + CONTRIBUTION_EPS),
                "contribution_per_token": per_token.mean(),
            } | self.memory.last_stats
