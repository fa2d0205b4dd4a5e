"""Mela: a Transformer++ decoder reading a Hierarchical Memory Module.

Paper: "Mela: Test-Time Memory Consolidation based on Transformation Hypothesis"
(arXiv:2605.10537), sections 3-4; section and equation numbers below are that paper's.

HMM (section 3, Figure 1). Token embeddings x (B, T, dim) (projected to memory_dim when it
differs from dim) are patchified by a 1-D convolution (kernel = stride = P) into x_p
(B, N_p, memory_dim), one episodic unit per P tokens. Two memory modules, L (fewer blocks) and H (more blocks), each = an input-fusion MLP
over concat of its two input states, then memory blocks
    x += GatedAttention(RMSNorm x);  x += NeuralMemory(RMSNorm x)
with the neural memory of `models/memory/neural_memory.py` updated by eq. 10-11 (momentum, forget
gate, Newton-Schulz-k on the momentum), processing patches in chunks of C, one update step
per chunk (`gates="chunk"`: section 3.1 takes one gradient per chunk as the surprise, and
Newton-Schulz orthogonalises that step). Mela describes none of the Titans layer's extras
(q/k/v conv, SiLU on v, output norm and gate), so `mela_memory()` turns them off.

Hierarchical latent recursion (section 3.2, HRM / TRM): l = h = x_p; H cycles, each with
L L-module steps  l <- f_L(l, h) + ...  and one H-module step  h <- f_H(h, l); the first
H-1 cycles run without gradients, the last with gradients. Fusion (3.3, eq. 12): z^(i) =
Fusion_i(l^(i), h^(i)), a 2-layer MLP over concat(l, h) per cycle (ablations: h only, or a
learned weighted sum). MemStack (4.2, eq. 13-14): z^(H) are the decoder's memory tokens;
z^(i), i < H, is added at the memory-token positions after decoder layer i.

Decoder (4.1): text in chunks of P*C tokens, each preceded by C memory tokens; attention
stays inside [memory tokens; chunk] (causal), so memory is the only path between chunks.

Choices where the paper is silent (each tested in tests/test_mela.py):
- No leak: chunk c's memory tokens are the HMM outputs of chunk c-1's C patches (they
  depend on tokens before chunk c only). Chunk 0 of a fresh stream reads a learned
  `memory_init` (C, dim), with zero MemStack additions.
- Read after write (`memory_read="after_write"`, default): inside the HMM, the patches of
  memory chunk c read their neural memories after chunk c is written (M_c, not M_{c-1}).
  Their outputs are consumed only by decoder chunk c+1, so this stays causal, and every
  write reaches the loss as soon as a sequence has a second decoder chunk. Reading before
  the write ("before_write", the Titans order) leaves the writes of the last two chunks
  unread: at the paper's ratio (4096 tokens = 2 chunks of P*C = 2048) the memory's k/v
  projections and gates would get exactly zero gradient. `min_trainable_seq_len` is the
  shortest training sequence whose loss reaches every memory write path.
- Inside the HMM, attention is causal over the patches of the same chunk (chunk-local), so
  the neural memories are the only cross-chunk channel there too and the carried state
  has constant size. Patch positions for RoPE are chunk-local (0..C-1).
- Memory chains (`memory_chain`). "per_step": each module step of the recursion (cycle i,
  L-step j; cycle i's H step) is its own stream over the chunks: its blocks' neural memories
  continue from that same step's state of the previous chunk, and the whole sequence runs
  through one step before the next (H*L + H chains). "per_block" (section 5.3: the memory
  "is updated and read across the full recurrent depth of HMM"): one memory per memory
  block, carried through every L- and H-step of a chunk and on to the next chunk, so the
  recursion runs chunk by chunk (a Python loop over the N_p / C chunks). The no-grad
  cycles' writes enter the gradient as constant increments (`straight_through`), so the
  initial weights and earlier chunks' writes still learn; per_block needs read-after-write
  (else the last step's write would reach the loss only through no-grad cycles). per_block
  is the default because it is what section 5.3 describes. Measured at debug scale
  (scripts/replicate_mela_length.py, 3 seeds, 50 held-out documents, docs/benchmarks.md):
  at eq. 10's unit step per_block scored 0.85x per_step's perplexity; at the default 0.1
  step it scores 1.08x (95% interval, seeds then documents, 1.01-1.13 at 1x-8x the training
  context), so at that scale per_step is better. Either way the carried state is constant
  in the context length and segment-by-segment equals one pass exactly.
- The step after Newton-Schulz (`memory_step_scale`, default 0.1). Eq. 10 as printed adds
  NS(S) with no step size; section 3.1 "leverages the Muon optimizer", whose step has a
  learning rate. A unit step makes the per-block memory chaotic (float32 and float64
  outputs of a fresh model part by ~5x per chunk, 1.0 by chunk 9); 0.1 keeps them within
  1e-5 and gives 0.92x the perplexity in scripts/replicate_mela_length.py (3 seeds, 44
  documents; docs/benchmarks.md). 1.0 is eq. 10 as printed.
- L-module input: Fuse_L(concat(l, h)) + x_p (input injection, as HRM's z_L + z_H + x);
  H-module input: Fuse_H(concat(h, l)). Each module ends with an RMSNorm so that l and h
  keep their scale over cycles. Fusion MLPs: Linear(2m, m) -> SiLU -> Linear(m, out).
- Decoder positions are chunk-local: memory tokens 0..C-1, text C..C+PC-1, so every chunk
  looks alike and context beyond the training length is purely a memory question.
- `memory_path=False` is the replication's control (scripts/replicate_mela_length.py): the
  same decoder and window, every chunk reading `memory_init` and zero MemStack additions;
  the HMM's parameters stay in the model, unused.
- Token embeddings are shared by the HMM and the decoder and tied to the output head (the
  paper's Table 1 leaves only "embedding and output projection" outside memory/language).
- Under autocast the HMM's Linear weights are cast once a forward and handed to its module
  steps (`models/layers/autocast_weights.py`: the same forward values; their gradients summed
  in bf16 before the one cast back, as eager autocast's weight cache and FSDP2's bf16
  parameters do; tests/test_autocast_weights.py).
- Streaming (`stream`): the state (neural memories of every HMM block, the last chunk's
  memory tokens) is carried from call to call, so a long text is evaluated segment by
  segment with constant memory; segments must be whole chunks except the last.

Shapes: tokens (B, T) -> logits (B, T, vocab_size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from models.layers.autocast_weights import call_with_linear_weights_cast
from models.layers.diagnostics import recording_on
from models.layers.ffn import swiglu_hidden
from models.layers.tracing import compiling
from models.memory.chunk_loop import MemoryState, stacked_state, state_stacks
from models.memory.neural_memory import NeuralMemory, NeuralMemoryConfig
from models.layers.decoder import Attention, DecoderBlock

FUSIONS = ("mlp", "h_only", "weighted_sum")
MEMORY_READS = ("after_write", "before_write")
MEMORY_CHAINS = ("per_step", "per_block")


def mela_memory(**overrides) -> NeuralMemoryConfig:
    """Mela's neural-memory options (module docstring), the fields MelaConfig sets left unset
    (`MelaConfig.block_memory`); `overrides` set any other field. No surprise bound
    (`max_update_norm` 0, the Titans memory's default being 20): the paper has none and its
    Newton-Schulz step is orthogonalised, so its norm is bounded by construction."""
    return NeuralMemoryConfig(**dict(gates="chunk", conv_kernel=0, value_silu=False, output_norm=False,
                                     output_gate=False, max_update_norm=0.0, chunk_size=None, newton_schulz_steps=None,
                                     step_scale=None, read_after_write=None) | overrides)


@dataclass
class MelaConfig:
    vocab_size: int = 4096
    dim: int = 128  # decoder hidden size
    n_layers: int = 4  # decoder layers
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    memory_dim: int | None = None  # HMM hidden size (default: dim)
    memory_heads: int = 4  # heads of the HMM's gated attention and neural memories
    memory_kv_heads: int | None = None  # key/value heads of the HMM's gated attention (default: memory_heads)
    h_layers: int = 2  # memory blocks of the H-module
    l_layers: int = 1  # memory blocks of the L-module
    h_cycles: int = 2  # H
    l_cycles: int = 2  # L
    patch_size: int = 8  # P
    chunk_size: int = 8  # C: patches per memory chunk = memory tokens per decoder chunk
    # The neural memory's own options; dim / heads / chunk / Newton-Schulz steps are set from the fields here.
    memory: NeuralMemoryConfig = field(default_factory=mela_memory)
    # Ablations of Table 4.
    newton_schulz_steps: int = 5  # 0: plain momentum update (eq. 4-5 instead of 10-11)
    memory_step_scale: float = 0.1  # lr on the orthogonalised step: M = alpha M + lr NS(S) (eq. 10 as printed: 1)
    memstack: bool = True
    attention_gating: bool = True
    fusion: str = "mlp"  # "mlp" | "h_only" | "weighted_sum"
    memory_read: str = "after_write"  # HMM memory chunk c reads M_c ("after_write") or M_{c-1} ("before_write")
    memory_chain: str = "per_block"  # one memory per block across the depth ("per_block") or per module step ("per_step")
    memory_path: bool = True  # False: every decoder chunk reads memory_init, the HMM never runs (a control)
    memory_attention: bool = True  # gated attention inside the memory blocks
    neural_memory: bool = True  # neural memory inside the memory blocks
    rope_theta: float = 10000.0
    max_seq_len: int = 1 << 20
    norm_eps: float = 1e-6
    init_std: float = 0.02
    tie_embeddings: bool = True

    def __post_init__(self):
        self.memory_dim = self.memory_dim or self.dim
        self.memory_kv_heads = self.memory_kv_heads or self.memory_heads
        self.n_kv_heads = self.n_kv_heads or self.n_heads
        self.ffn_hidden = self.ffn_hidden or swiglu_hidden(self.dim)
        if self.fusion not in FUSIONS:
            raise ValueError(f"Mela fusion '{self.fusion}' unknown: choose one of {FUSIONS}")
        if self.memory_read not in MEMORY_READS:
            raise ValueError(f"Mela memory_read '{self.memory_read}' unknown: choose one of {MEMORY_READS}")
        if self.memory_chain not in MEMORY_CHAINS:
            raise ValueError(f"Mela memory_chain '{self.memory_chain}' unknown: choose one of {MEMORY_CHAINS}")
        if self.memory_chain == "per_block" and self.memory_read != "after_write":
            raise ValueError("Mela memory_chain 'per_block' needs memory_read 'after_write' (reading before the write, "
                             "the last step's write reaches later chunks only through no-grad cycles): pass "
                             "memory_chain='per_step' with memory_read='before_write'")
        if not (self.memory_attention or self.neural_memory):
            raise ValueError("Mela memory blocks need attention or neural memory (or both): do not turn off both")
        if self.memstack and self.h_cycles - 1 > self.n_layers:
            raise ValueError(f"MemStack adds after decoder layers 1..H-1: h_cycles {self.h_cycles} needs "
                             f"n_layers >= {self.h_cycles - 1} (got {self.n_layers})")
        if self.memory_dim % self.memory_heads or self.dim % self.n_heads:
            raise ValueError(f"memory_dim {self.memory_dim} must divide by memory_heads {self.memory_heads} "
                             f"and dim {self.dim} by n_heads {self.n_heads}")
        self.block_memory  # a conflicting memory field ends here

    @property
    def block_memory(self) -> NeuralMemoryConfig:
        """The neural memory each memory block builds: `memory` with the HMM's width and
        heads, the chunk C, the Newton-Schulz steps, the step scale and the read order set
        here (`NeuralMemoryConfig.filled_by` refuses a conflicting value set on `memory`)."""
        return self.memory.filled_by(
            "MelaConfig", dim=self.memory_dim, n_heads=self.memory_heads, head_dim=self.memory_dim // self.memory_heads,
            chunk_size=self.chunk_size, newton_schulz_steps=self.newton_schulz_steps,
            step_scale=self.memory_step_scale, read_after_write=self.memory_read == "after_write")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def chunk_tokens(self) -> int:
        """Text tokens per decoder chunk (P * C)."""
        return self.patch_size * self.chunk_size

    @property
    def stream_segment(self) -> int:
        """`Mela.stream` calls must be multiples of this (but the last): one chunk."""
        return self.chunk_tokens

    @property
    def min_trainable_seq_len(self) -> int:
        """Shortest training sequence whose loss reaches the memory writes: a second decoder
        chunk reading after the write, a third reading before it."""
        return (1 if self.memory_read == "after_write" else 2) * self.chunk_tokens + 1

    @property
    def memory_chains(self) -> tuple[int, int]:
        """(L-module, H-module) memory chains a stream carries: one per module step (H*L, H)
        or one per block (1, 1: each holding every block's memory)."""
        if self.memory_chain == "per_block":
            return 1, 1
        return self.h_cycles * self.l_cycles, self.h_cycles

    @property
    def window(self) -> int:
        """Attention span of a decoder token: its chunk and the chunk's memory tokens."""
        return self.chunk_tokens + self.chunk_size


class FusionMLP(nn.Module):
    """Linear(in, hidden) -> SiLU -> Linear(hidden, out). x (..., in) -> (..., out)."""

    def __init__(self, d_in: int, hidden: int, d_out: int):
        super().__init__()
        self.w1 = nn.Linear(d_in, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)))


class OutputFusion(nn.Module):
    """z = Fusion(l, h) (eq. 12): l, h (B, N_p, memory_dim) -> z (B, N_p, dim).
    "mlp": 2-layer MLP over concat(l, h); "h_only": h (HRM/TRM); "weighted_sum":
    w_l * l + w_h * h with per-channel weights (init 1/2). The last two project to dim
    with a linear map when memory_dim != dim."""

    def __init__(self, cfg: MelaConfig):
        super().__init__()
        self.mode = cfg.fusion
        m, d = cfg.memory_dim, cfg.dim
        if self.mode == "mlp":
            self.mlp = FusionMLP(2 * m, m, d)
            return
        if self.mode == "weighted_sum":
            self.weights = nn.Parameter(torch.empty(2, m))
        self.proj = nn.Linear(m, d, bias=False) if m != d else nn.Identity()

    def forward(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """low, high: the l and h states."""
        if self.mode == "mlp":
            return self.mlp(torch.cat([low, high], -1))
        if self.mode == "weighted_sum":
            high = self.weights[0] * low + self.weights[1] * high
        return self.proj(high)


class MemoryBlock(nn.Module):
    """x += GatedAttention(norm x) over the patches of each chunk; x += NeuralMemory(norm x)."""

    def __init__(self, cfg: MelaConfig):
        super().__init__()
        self.chunk = cfg.chunk_size
        m = cfg.memory_dim
        if cfg.memory_attention:
            self.attention_norm = nn.RMSNorm(m, eps=cfg.norm_eps)
            self.attention = Attention(m, cfg.memory_heads, cfg.memory_kv_heads, cfg.rope_theta,
                                       gated=cfg.attention_gating)
        if cfg.neural_memory:
            self.memory_norm = nn.RMSNorm(m, eps=cfg.norm_eps)
            self.memory = NeuralMemory(cfg.block_memory)

    def forward(self, x: torch.Tensor, state: MemoryState | None):
        """x (B, N_p, m) with N_p a multiple of C; state of the neural memory (None: fresh)."""
        if hasattr(self, "attention"):
            chunks = self.attention_norm(x).unflatten(1, (-1, self.chunk)).flatten(0, 1)  # (B * N_p / C, C, m)
            positions = torch.arange(self.chunk, device=x.device)
            x = x + self.attention(chunks, positions).view_as(x)
        if hasattr(self, "memory"):
            out, state = self.memory(self.memory_norm(x), state)
            x = x + out
        return x, state


class MemoryModule(nn.Module):
    """The L- or H-module: RMSNorm(blocks(Fuse(concat(a, b)) + injection))."""

    def __init__(self, cfg: MelaConfig, n_blocks: int):
        super().__init__()
        m = cfg.memory_dim
        self.input_fusion = FusionMLP(2 * m, m, m)
        self.blocks = nn.ModuleList(MemoryBlock(cfg) for _ in range(n_blocks))
        self.norm = nn.RMSNorm(m, eps=cfg.norm_eps)

    def fresh_states(self, x: torch.Tensor) -> tuple:
        """Fresh block states for activations x (B, ..., m): each neural memory's initial
        weights (None for a block without one)."""
        return tuple(block.memory.empty_state(x.shape[0], x.device, x.dtype) if hasattr(block, "memory") else None
                     for block in self.blocks)

    def forward(self, a: torch.Tensor, b: torch.Tensor, injection: torch.Tensor | None, states: tuple | None):
        """a, b (B, N_p, m); states: one neural-memory state (or None) per block, or None
        (all fresh).
        Returns (B, N_p, m) and the blocks' new states."""
        x = self.input_fusion(torch.cat([a, b], -1))
        if injection is not None:
            x = x + injection
        new_states = []
        for block, state in zip(self.blocks, states or (None,) * len(self.blocks)):
            x, state = block(x, state)
            new_states.append(state)
        return self.norm(x), tuple(new_states)


class HierarchicalMemory(nn.Module):
    """HMM: patchify, hierarchical latent recursion, per-cycle fusion (section 3)."""

    def __init__(self, cfg: MelaConfig):
        super().__init__()
        self.cfg = cfg
        m = cfg.memory_dim
        self.embed_proj = nn.Linear(cfg.dim, m, bias=False) if cfg.dim != m else nn.Identity()
        self.patchify = nn.Conv1d(m, m, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.l_module = MemoryModule(cfg, cfg.l_layers)
        self.h_module = MemoryModule(cfg, cfg.h_layers)
        # One fusion per cycle whose output is used: all H with MemStack, else the last.
        self.fusions = nn.ModuleList(OutputFusion(cfg) for _ in range(cfg.h_cycles if cfg.memstack else 1))
        self.last_stats: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor, l_states: tuple, h_states: tuple):
        """x (B, T, dim) embeddings of whole chunks (T a multiple of P*C); l_states, h_states:
        the carried memory chains (`MelaConfig.memory_chains` of each; None: fresh), each a
        tuple of block states.
        Returns [z^(1), ..., z^(H)] with MemStack (else [z^(H)]), each (B, T / P, dim),
        and the new l_states, h_states."""
        x_p = self.patchify(self.embed_proj(x).transpose(1, 2)).transpose(1, 2)
        if self.cfg.memory_chain == "per_step":
            return self.recursion(x_p, l_states, h_states)
        per_chunk = []
        for chunk in x_p.split(self.cfg.chunk_size, dim=1):
            zs, l_states, h_states = self.recursion(chunk, l_states, h_states)
            per_chunk.append(zs)
        return [torch.cat(parts, 1) for parts in zip(*per_chunk)], l_states, h_states

    def recursion(self, x_p: torch.Tensor, l_states: tuple, h_states: tuple):
        """Hierarchical latent recursion (section 3.2) over patches x_p (B, N_p, m), N_p a
        multiple of C. Step k of the L-module (k = cycle * L + j) continues chain
        l_states[k] per_step, chain 0 per_block; likewise the H-module's steps. The cycles
        before the last run under no_grad in `settle` (HRM's one-step gradient), the last with
        the caller's grad mode.
        Returns the fused outputs (as `forward`) and the updated chains."""
        cfg = self.cfg
        shared = cfg.memory_chain == "per_block"
        if shared:
            l_states = (l_states[0] or self.l_module.fresh_states(x_p),)
            h_states = (h_states[0] or self.h_module.fresh_states(x_p),)
            entering = l_states[0], h_states[0]
        else:  # fresh chains as states, not None: one call structure for the compiled modules
            l_states = tuple(states or self.l_module.fresh_states(x_p) for states in l_states)
            h_states = tuple(states or self.h_module.fresh_states(x_p) for states in h_states)
        with torch.no_grad():
            settled, l_states, h_states = self.settle(x_p, l_states, h_states)
        low = high = x_p  # the paper's l and h states
        zs, changes = [], {}
        for cycle, after in enumerate(settled + [None]):
            before = low.detach(), high.detach()
            if after is None:  # the last cycle
                if cycle > 0 and shared:
                    l_states, h_states = ((straight_through(entering[0], l_states[0]),),
                                          (straight_through(entering[1], h_states[0]),))
                low, high, l_states, h_states = self.cycle(cycle, low, high, x_p, l_states, h_states)
            else:
                low, high = after
            if recording_on():
                changes |= {f"cycle{cycle}/{name}_change": relative_norm(now.detach() - prior, prior)
                            for name, now, prior in (("l", low, before[0]), ("h", high, before[1]))}
            if cfg.memstack or after is None:
                zs.append(self.fusions[len(zs)](low, high))
        if recording_on():
            self.last_stats = changes
        return zs, l_states, h_states

    def settle(self, x_p: torch.Tensor, l_states: tuple, h_states: tuple):
        """The recursion's cycles before the last (`cycle`; the caller runs them under no_grad):
        returns [(l, h) after each cycle], and the chains after them. Not compiled as one graph:
        tried on 2026-12-03, it removed 12 of mela_400m's 7,318 launches a step (docs/benchmarks.md)."""
        low = high = x_p
        settled = []
        for cycle in range(self.cfg.h_cycles - 1):
            low, high, l_states, h_states = self.cycle(cycle, low, high, x_p, l_states, h_states)
            settled.append((low, high))
        return settled, l_states, h_states

    def cycle(self, cycle: int, low: torch.Tensor, high: torch.Tensor, x_p: torch.Tensor, l_states: tuple,
              h_states: tuple):
        """One H-cycle: L steps of the L-module, then one of the H-module (section 3.2). States
        (B, N_p, m) low, high; chains as `recursion`'s. Returns the new low, high and chains."""
        cfg = self.cfg
        shared = cfg.memory_chain == "per_block"
        l_states, h_states = list(l_states), list(h_states)
        for step in range(cycle * cfg.l_cycles, (cycle + 1) * cfg.l_cycles):
            k = 0 if shared else step
            low, l_states[k] = uniform_call(self.l_module, low, high, x_p, l_states[k])
        k = 0 if shared else cycle
        high, h_states[k] = uniform_call(self.h_module, high, low, None, h_states[k])
        return low, high, tuple(l_states), tuple(h_states)


def uniform_call(module: nn.Module, *inputs):
    """module(*inputs) for an L- or H-module; when the module is compiled (nn.Module.compile sets
    `_compiled_call_impl`), its inputs (a, b, injection, states) first get every tensor's requires_grad
    equal to the grad mode, so each compiled module (torchtitan_ext/families/mela.py `compile_hmm`)
    keeps one graph per grad mode and state structure where dynamo, which guards on each
    input's requires_grad, made one per combination (11 graphs at the debug flavor's first
    step, 5 now; tests/test_mela.py). Under no_grad (HRM's earlier cycles, evaluation) every
    tensor is detached; under grad a tensor that does not require grad (the detached l and h
    entering the last cycle, a fresh chain's zero momentum) becomes a detached leaf that does:
    values and every other gradient are unchanged, and the leaf's own gradient, one small
    product of the input fusion or an addition, is dropped. Traced inside a larger compiled
    region (the whole training step), the modules are inlined into one graph with no guards of
    their own, so the inputs pass unchanged (dynamo refuses requires_grad_ there); an eager
    module gets them unchanged too (no copies on the uncompiled path)."""
    if module._compiled_call_impl is None or torch.compiler.is_compiling():
        return module(*inputs)
    return module(*uniform_inputs(inputs))


def uniform_inputs(inputs: tuple) -> tuple:
    """`inputs` (tensors and memory states nested in tuples) with every floating tensor
    contiguous (an empty one replaced by zeros: strides too are guarded) and its requires_grad
    equal to the grad mode: detached under no_grad, a detached leaf that requires grad under
    grad (`uniform_call`). A state holding its [M; S] stacks (`MemoryState.stacked`) is rebuilt
    as views of its stacks made uniform, so its weights and momenta keep the stacks' strides
    instead of being copied to contiguous tensors at every call."""
    grad = torch.is_grad_enabled()

    def uniform(t):
        if isinstance(t, MemoryState):
            if t.stacked is not None:
                return stacked_state(*tree_map(uniform, (t.stacked, t.pending, t.conv)))
            return MemoryState(*tree_map(uniform, tuple(t)))
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        t = t.contiguous() if t.numel() else t.new_zeros(t.shape)
        if t.requires_grad == grad:
            return t
        return t.detach().requires_grad_() if grad else t.detach()

    return tree_map(uniform, inputs, is_leaf=lambda t: isinstance(t, MemoryState))


class _StraightThrough(torch.autograd.Function):
    """carry(before, now): the value of `now`, the gradient to `before` as the identity
    (M_before + (M_now - M_before).detach() without its two launches and their rounding).
    Eager only (`carry`)."""

    @staticmethod
    def forward(ctx, before: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
        return now.view_as(now)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def carry(before: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """The value of `now`, the gradient to `before` as the identity. Eagerly `_StraightThrough`
    (no launch); traced by torch.compile, now.detach() + (before - before.detach()): exactly
    `now` where `before` is finite (x - x = 0), one fused pointwise kernel, and no custom
    autograd.Function in the graph (AOTAutograd's cache bypasses a graph holding one,
    models/memory/chunk_write.py `silu_backward`)."""
    if compiling():
        return now.detach() + (before - before.detach())
    return _StraightThrough.apply(before, now)


def straight_through(entering: tuple, after: tuple) -> tuple:
    """Block states `after` the no-grad cycles, whose weights and momenta pass gradient to
    the `entering` states as the identity: the value of M_after, the gradient of M_entering
    (`carry`, on the [M; S] stacks, whose views the new states' weights and momenta are). The
    no-grad cycles' writes enter as constant increments (HRM's one-step gradient, applied to
    the memory chain), so a per_block chain's initial weights and earlier chunks' writes still
    learn when H > 1."""
    return tuple(None if now is None else
                 stacked_state(tuple(map(carry, state_stacks(before), state_stacks(now))), now.pending, now.conv)
                 for before, now in zip(entering, after))


def relative_norm(part: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """||part|| / ||whole|| as a detached float32 scalar (diagnostics)."""
    with torch.no_grad():
        return part.float().norm() / whole.float().norm().clamp_min(1e-12)


class MelaState(NamedTuple):
    """What a stream carries between calls: the memory chains of the L- and H-module
    (`MelaConfig.memory_chains`), each a tuple of block states or None (fresh), the memory tokens for the next chunk
    ([z^(1..H)] or [z^(H)], each (B, C, dim)), and whether the last call ended on a
    chunk boundary."""

    l_states: tuple
    h_states: tuple
    memory_tokens: tuple[torch.Tensor, ...]
    on_boundary: bool = True


class Mela(nn.Module):
    """Mela LM. Attribute names (tok_embeddings, layers, norm, lm_head) follow torchtitan's
    decoders so its AC / compile / FSDP2 helpers apply to the decoder blocks."""

    _skip_lm_head: bool = False

    def __init__(self, cfg: MelaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.hmm = HierarchicalMemory(cfg)
        self.memory_init = nn.Parameter(torch.empty(cfg.chunk_size, cfg.dim))
        self.layers = nn.ModuleDict({
            str(i): DecoderBlock(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden, cfg.rope_theta, cfg.norm_eps,
                                 prefix_keys=cfg.chunk_size)
            for i in range(cfg.n_layers)
        })
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.enable_weight_tying = cfg.tie_embeddings
        self.last_stats: dict[str, torch.Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, init_std) for embeddings, memory tokens and HMM linear maps; decoder blocks
        as Transformer++; neural memories their own init; norms to one, weighted-sum
        fusion weights to 1/2. Re-ties the output head (needed after to_empty)."""
        cfg, std = self.cfg, self.cfg.init_std
        with torch.no_grad():
            if self.enable_weight_tying:
                self.lm_head.weight = self.tok_embeddings.weight
            else:
                nn.init.normal_(self.lm_head.weight, std=cfg.dim**-0.5)
            nn.init.normal_(self.tok_embeddings.weight, std=std)
            nn.init.normal_(self.memory_init, std=std)
            for block in self.layers.values():
                block.reset_parameters(std, cfg.n_layers)
            self.norm.reset_parameters()
            for module in self.hmm.modules():
                if isinstance(module, (nn.Linear, nn.Conv1d)):
                    nn.init.normal_(module.weight, std=std)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
                elif isinstance(module, (nn.RMSNorm, NeuralMemory)):
                    module.reset_parameters()
                elif isinstance(module, OutputFusion) and module.mode == "weighted_sum":
                    nn.init.constant_(module.weights, 0.5)

    def initial_state(self, batch: int) -> MelaState:
        """A fresh stream: fresh neural memories, `memory_init` as chunk 0's memory tokens
        and zero MemStack additions."""
        cfg = self.cfg
        first = self.memory_init.expand(batch, -1, -1)
        stack = (torch.zeros_like(first),) * (cfg.h_cycles - 1 if cfg.memstack else 0)
        l_chains, h_chains = cfg.memory_chains
        return MelaState((None,) * l_chains, (None,) * h_chains, stack + (first,))

    def memstack_addition(self, z: torch.Tensor) -> torch.Tensor:
        """z (B', C, dim) memory features of each chunk -> (B', C + P*C, dim): z at the
        memory-token positions, exactly zero at every text position (eq. 13)."""
        return F.pad(z, (0, 0, 0, self.cfg.chunk_tokens))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, attention_masks: None = None):
        """tokens (B, T) -> logits (B, T, vocab) from a fresh memory. Each row is one
        stream; `positions` exists for torchtitan's call signature and is ignored."""
        if attention_masks is not None:
            raise ValueError("Mela builds its own chunk masks; pass attention_masks=None")
        return self.stream(tokens)[0]

    def stream(self, tokens: torch.Tensor, state: MelaState | None = None):
        """tokens (B, T) continuing the stream in `state` (None: a fresh one) ->
        (logits (B, T, vocab) or hidden states with `_skip_lm_head`, new state)."""
        cfg = self.cfg
        batch, length = tokens.shape
        if length > cfg.max_seq_len:
            raise ValueError(f"sequence length {length} exceeds max_seq_len {cfg.max_seq_len}")
        if state is None:
            state = self.initial_state(batch)
        elif not state.on_boundary:
            raise ValueError(f"Mela streams whole chunks: every segment but the last must be a multiple of "
                             f"patch_size * chunk_size = {cfg.chunk_tokens} tokens")
        span, c = cfg.chunk_tokens, cfg.chunk_size
        x = self.tok_embeddings(tokens)
        full = length // span * span
        l_states, h_states = state.l_states, state.h_states
        if full and cfg.memory_path:
            # its L- and H-modules run 40 times a step at 400m: their weights cast once (autocast_weights)
            zs, l_states, h_states = call_with_linear_weights_cast(self.hmm, x[:, :full], l_states, h_states)
        elif full:  # the control: every chunk reads what chunk 0 of a fresh stream reads
            zs = [t.repeat(1, full // span, 1) for t in self.initial_state(batch).memory_tokens]
        else:
            zs = [t[:, :0] for t in state.memory_tokens]
        # Chunk k reads the HMM output of chunk k - 1 (chunk 0: the carried tokens).
        memory = [torch.cat([carried, z], 1) for carried, z in zip(state.memory_tokens, zs)]
        n_chunks = -(-length // span)
        new_state = MelaState(l_states, h_states, tuple(m[:, full // cfg.patch_size:] for m in memory), full == length)
        memory = [m[:, : n_chunks * c].unflatten(1, (n_chunks, c)).flatten(0, 1) for m in memory]  # (B * n, C, dim)
        text = F.pad(x, (0, 0, 0, n_chunks * span - length)).unflatten(1, (n_chunks, span)).flatten(0, 1)
        h = torch.cat([memory[-1], text], 1)
        positions = torch.arange(c + span, device=tokens.device)
        memstack = {}
        for i, block in enumerate(self.layers.values()):
            h = block(h, positions)
            if i < len(memory) - 1:
                if recording_on():
                    memstack[f"decoder{i}/memstack_ratio"] = relative_norm(memory[i], h[:, :c])
                h = h + self.memstack_addition(memory[i])
        if recording_on():
            self.last_stats = memstack
        h = h[:, c:].unflatten(0, (batch, n_chunks)).flatten(1, 2)[:, :length]
        h = self.norm(h)
        return (h if self._skip_lm_head else self.lm_head(h)), new_state


def parameter_groups(model: Mela) -> dict[str, int]:
    """Parameter counts: memory (HMM + memory_init), language (decoder blocks + final
    norm) and embedding (token embeddings, plus the output head when untied)."""
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    embedding = model.tok_embeddings.weight.numel() + (0 if model.enable_weight_tying else model.lm_head.weight.numel())
    return {
        "memory": count(model.hmm) + model.memory_init.numel(),
        "language": count(model.layers) + count(model.norm),
        "embedding": embedding,
    }


def mela_diagnostics(model: nn.Module) -> dict[str, float]:
    """Diagnostics of the last forward recorded (`models.layers.diagnostics.recording`), found through
    wrappers (FSDP, AC, compile):
    `memory/hmm/{l,h}<block>/...` each HMM neural memory's statistics (theta / eta / alpha
    means, fast-weight and momentum norms, update-to-weight ratio; of the last module step
    that ran it), `memory/hmm/cycle<i>/{l,h}_change` (||state after cycle i - before|| /
    ||before||), `memory/decoder<i>/memstack_ratio` (||MemStack addition|| / ||residual at the
    memory tokens||) and `memory/decoder<i>/memory_attention_mass` (attention probability the
    last 64 queries of each chunk put on its memory tokens)."""
    metrics = {}
    for name, module in model.named_modules():
        if isinstance(module, HierarchicalMemory):
            for kind, part in (("l", module.l_module), ("h", module.h_module)):
                for i, block in enumerate(part.blocks):
                    if hasattr(block, "memory"):
                        metrics |= {f"memory/hmm/{kind}{i}/{k}": v for k, v in block.memory.last_stats.items()}
            metrics |= {f"memory/hmm/{k}": v for k, v in module.last_stats.items()}
        elif isinstance(module, Mela):
            metrics |= {f"memory/{k}": v for k, v in module.last_stats.items()}
        elif isinstance(module, DecoderBlock) and module.attention.last_prefix_mass is not None:
            layer = name.split("layers.")[-1].split(".")[0]
            metrics[f"memory/decoder{layer}/memory_attention_mass"] = module.attention.last_prefix_mass
    return {k: float(v) for k, v in metrics.items()}
