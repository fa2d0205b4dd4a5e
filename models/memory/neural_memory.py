"""Titans neural long-term memory.

Titans: Learning to Memorize at Test Time (Behrouz, Zhong, Mirrokni; arXiv:2501.00663),
section 3, as restated in the MemoryLlama thesis (section 2.3, eq. 2.38-2.41), with Mela's
Newton-Schulz update (Mela: Test-Time Memory Consolidation, eq. 10-11) as an option.

The memory is a per-head MLP `M` (fast weights) written at test time by gradient descent
on the associative loss `l(M; k_t, v_t) = ||M(k_t) - v_t||^2`:

    S_t = eta_t S_{t-1} - theta_t u_t,   u_t = grad l(M; k_t, v_t)     (thesis eq. 2.39)
    M_t = (1 - alpha_t) M_{t-1} + S_t                                  (thesis eq. 2.40)
    M_t = (1 - alpha_t) M_{t-1} + NewtonSchulz_k(S_t)                  (Mela eq. 10-11)
    y_t = M*(q_t), read from the state left by the previous chunk        (thesis 2.41)

Chunked training: the sequence is cut into chunks of C tokens and the tokens of chunk c
read the state left by chunk c-1 (M_{c-1}). Two write rules (`gates`):

- "token" (default, the Titans paper's parallelised training, its section 3.2): every token's
  gradient u_t is taken at the chunk-start weights M_{c-1}, then the momentum and forget
  gates are applied per token by the scan above. Unrolled over a chunk of tokens 1..C
  (E = cumulative eta products, R = forget products to the chunk end):

      S_C = (prod_j eta_j) S_0 - sum_i theta_i (prod_{i<j<=C} eta_j) u_i
      M_C = (prod_j (1-alpha_j)) M_0 + (sum_t R_t E_t) S_0
            - sum_i theta_i (sum_{t>=i} R_t prod_{i<j<=t} eta_j) u_i

  so the chunk costs two weighted sums of per-token gradients (one batched matmul per
  weight matrix) and one 2 x 2 mix of the stacked [M; S] (one more per matrix). The
  weights of the sums and the mix depend on the gates alone: (C+1)^2 decay products from a
  log-space segment sum, computed for all chunks at once before the sequential loop
  (`chunk_gates`). Decay and momentum time scales do not depend on C. With C = 1 this is
  online gradient descent.
- "chunk" (TTT / LaCT style): one optimiser step per chunk, S = mean(eta) S - sum_t theta_t u_t,
  M = (1 - mean(alpha)) M + step_scale [NS](S), through `kernels.memory_update` (fused Triton on GPU).
  Newton-Schulz needs this rule: NS is not linear, so orthogonalising every token's
  momentum cannot be folded into weighted gradient sums (C NS iterations per chunk), and
  Mela (section 3.1) writes one gradient per chunk ("the resulting gradient then serves
  as the surprise signal"). `newton_schulz_steps > 0` with `gates="token"` is refused.

One chunk's write (the MLP's forward, the weighted gradient sums, the gates' weights, the
surprise bound, the per-token rule's update) is in models/memory/chunk_write.py; this module
holds the options, the chunk loop and the layer.

Layer around the memory (the Titans paper's architectural details; each an option, the
paper's choice the default): q, k, v linear projections, each followed by a causal
depthwise 1D convolution (`conv_kernel` 4), then SiLU and L2 normalisation on q and k
(`qk_norm`) and SiLU on v (`value_silu`); the read goes through a per-head RMSNorm
(`output_norm`) and a gate (`output_gate`) before the output projection.

Precision rule: the fast-weight state (weights, momentum, pending chunk) is float32 whatever
the parameters' and activations' dtype (float64 when the activations are float64, so exact
tests stay exact); the memory's inner matmuls run in that dtype and the read is cast back to
the activations' dtype before the output norm. `state_dtype` forces another dtype (only to
measure what bf16 state costs).

Choices where the papers are silent (tested):
- By default `M` has no residual: depth 1 is `x W`, depth L applies L matrices with SiLU
  between them (hidden width = expansion * head_dim). `residual` adds one skip around
  them, M(x) = x + MLP(x) (the MemoryLlama thesis' "MLPs with residual connections",
  section 2.3): the write's gradient keeps its form, with M(k) in the error. Initial
  weights are learned (`learned_init`), else a fixed random draw (zeros would never learn
  for depth >= 2).
- `output_proj=False` drops the output projection: the read is the heads' concatenation
  itself (M*(q), MemoryLlama's eq. 4.2 / 4.7; needs n_heads * head_dim == dim).
- The loss is summed over tokens and features; theta = max_lr * sigmoid(.), max_lr 0.01
  (0.1 diverged to NaN within 10 steps for MAL at debug size). The forget gate's logit is
  offset by -4 (alpha starts near 0.018 per token).
- The output gate is one sigmoid per head and token, computed from the layer input
  (Linear(dim, n_heads), as titans-pytorch's retrieve gate): it keeps the paper-sized
  parameter counts. The conv has no bias and torch's default init.
- MAC's retrieval (`retrieve`) reads with queries of a different stream (the segment's
  inputs, not the written attention outputs): their conv runs with zero history at each
  call, while the written stream's conv history is carried in the state.
- A trailing partial chunk is not written yet: its keys/values wait in the state
  (`MemoryState.pending`) until the chunk completes in a later call, and the conv carries
  its last `conv_kernel - 1` inputs, so processing a sequence in segments of any length
  gives exactly the one-pass outputs.
- `read_after_write` (used by Mela's HMM, whose chunk-c outputs feed only later decoder
  chunks): chunk c reads M_c, the state after its own write, instead of M_{c-1}. Not causal
  inside a chunk, so only for consumers that use a chunk's outputs after the whole chunk;
  it needs whole chunks.
- `whole_sequence` runs all whole chunks of a call through `kernels.whole_sequence_memory`:
  one Triton launch forward and one backward per layer whatever T (the chunk loop's launches
  grow with T), the state entering every `checkpoint_chunks`-th chunk (every chunk's at 0)
  kept for the backward, which recomputes the rest from it (`compiled_chunk_step` does not
  apply to it). Under bf16 autocast its fast-weight products take bf16-rounded operands (the values
  autocast gives the chunk loop's matmuls; multiplied on the FMA units, kernels/whole_sequence_triton.py); the state and its update stay fp32; the surprise bound
  (`max_update_norm`) is applied inside the kernels, as the chunk loop applies it. Depth 2,
  float32 state, a CUDA device (TRITON_INTERPRET=1 on CPU); anything else runs the chunk loop after a warning naming why. Off by default until
  a GPU measures it faster.
  A call of whole chunks with nothing pending and no diagnostics recorded prepares the kernels'
  inputs (the conv, q/k SiLU and L2 norm, v, theta and the gates' chunk weights and mix for either
  rule, the layout) in one launch (`kernels.memory_inputs.chunk_inputs`, from the projections;
  Mela's and MemoryLlama's before the gates' bias, Titans MAC's with it), where Inductor makes
  eleven (the chunk rule, no conv) to seventeen (Titans' conv and per-token rule) kernels of
  `write`'s ops; the same values (tests/test_memory_inputs.py).
- `checkpoint_chunks = G > 0` recomputes each group of G chunks in backward (only the state
  at group boundaries is kept): fewer bytes saved per token for about one more forward.
- `max_update_norm = b` bounds the surprise; None (the default) means b = SURPRISE_BOUND = 20 for
  the plain-gradient rules and 0 (off) with Newton-Schulz, whose step NS(S) is orthogonalised,
  so its norm does not grow with the surprise's (`surprise_bound`). Titans has no bound; 0
  turns it off. Mela and MemoryLlama set 0 (Mela: its Newton-Schulz step; MemoryLlama: the
  thesis' block as printed).
  Why on by default (issue 46): the per-token rule takes a chunk's C gradients at the
  chunk-start weights, so one chunk is a gradient step of size about C theta / (1 - eta) on
  the associative loss, whose curvature grows with the fast weights (and, through W_2, with
  the values). Outer training can grow the values' scale at no cost to the read (the output
  norm removes it): on MQAR (titans_mal, width 64, T 128, chunk 16, lr 1e-2) the first
  layer's value projection grew 2.8x in 82 steps while its gates stayed put (eta 0.51-0.54,
  theta half of max_lr), its weighted mean surprise norm rose from 1 to 14, then 34 at step
  82, and at step 83 it grew geometrically from chunk to chunk within one forward to inf: the
  loss was NaN. The outer gradient clip cannot prevent it (it acts after the forward).
  docs/benchmarks.md "Titans memory finite by default" has the figures.
  What is bounded: the surprise term of thesis eq. 2.39 as the chunked step applies it. Each
  weighted sum of a chunk's per-token gradients that is added to the state,
  G = sum_t w_t u_t (u_t = grad l(M; k_t, v_t), the surprise), is scaled so that
  ||G||_F <= b sum_t |w_t| (`chunk_write.clip_surprise`): the weighted mean of the chunk's
  surprise norms is at most b, whatever the gates' step (theta, eta, alpha) and the chunk size,
  which keep their paper meaning. Separately per batch row, head and weight matrix. The chunk
  rule has one such sum, G = sum_t theta_t u_t, clipped before the momentum (S = eta S - G);
  the per-token rule has two, the chunk's addition to the momentum,
  sum_i theta_i (prod_{i<j<=C} eta_j) u_i, and to the weights,
  sum_i theta_i (sum_{t>=i} R_t prod_{i<j<=t} eta_j) u_i (the unrolled sums above), each
  clipped. The scale s = limit / max(||G||, limit) is exactly 1 where a sum is within its
  limit, and a constant in backward (d(sG)/dG = s, as a gradient clip's): forward and backward
  equal the unbounded memory's wherever nothing is clipped.
  Why this quantity: a sum is what the chunked path materialises (clipping each token's u_t
  would need the C per-token gradients the fused sums avoid); relative to the sum of the
  weights so the bound is one of the surprise, not of the step (a bound on ||G|| itself would
  tighten as C, theta or 1 / (1 - eta) grow); per row and head because each is an independent
  memory (one outlier sequence must not shrink another's writes); per matrix because the
  layers' gradient scales differ; the Frobenius norm because it bounds the spectral norm.
  With it a chunk adds at most b sum_t |w_t| to each matrix, so the state grows at most
  linearly over a sequence instead of geometrically: finite.
  Why 20: in short MQAR runs of LMM, MAC, MAG and MAL (widths 64 and 128, chunks 16 and 64,
  150-300 steps) the weighted mean surprise norm stayed at most 8.3, and in the run above at
  most 14 until the step before it diverged; a divergence passes any fixed bound within a few
  chunks. Longer runs grow the values and with them the surprise: in the MQAR suite's LMM run
  (900 steps) the bound first clips at step 468 and clips up to 12% of the sums by step 900
  (validation accuracy within the unbounded run's seed spread, docs/benchmarks.md), so
  `clipped_share` is worth watching in long runs.
  The share of sums clipped in the last recorded forward (`models.layers.diagnostics.recording`) is
  `last_stats["clipped_share"]`, which the training log reports at each logged step
  (torchtitan_ext/training/trainer.py). The chunk loop and the whole-sequence kernels apply
  the bound; the fused token step has none: it runs only with `max_update_norm = 0` (and falls
  back to the chunk loop with a warning otherwise).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.memory_inputs import chunk_inputs
from kernels.memory_inputs import refusal as memory_inputs_refusal
from models.layers.diagnostics import recording_on
from models.layers.tracing import compiling, project_together
from models.memory.chunk_loop import MemoryState, UpdateRule, chunked_memory, stacked_state, whole_chunks_memory
from models.memory.chunk_write import mlp_forward

GATE_RULES = ("token", "chunk")
# the fields an owning model may leave None in its nested memory config and set (`filled_by`)
OWNER_FIELDS = ("dim", "n_heads", "head_dim", "chunk_size", "newton_schulz_steps", "step_scale", "read_after_write")
# The default bound on a chunk's weighted mean surprise norm (`max_update_norm`, module docstring).
SURPRISE_BOUND = 20.0
FORGET_LOGIT_OFFSET = -4.0  # alpha = sigmoid(logit - 4): a fresh memory forgets ~1.8% per token


@dataclass
class NeuralMemoryConfig:
    """The memory's options. A field left None is set by the model that owns the memory
    (`filled_by`: Titans sets dim / n_heads / head_dim, Mela those and its chunk, step and
    read options); a memory built on its own must set dim, n_heads and head_dim."""

    dim: int | None = None
    n_heads: int | None = None
    head_dim: int | None = None
    depth: int = 2
    expansion: int = 4
    chunk_size: int | None = 64
    momentum: bool = True
    forget: bool = True
    gates: str = "token"  # "token": per-token scan (Titans 3.2); "chunk": one step per chunk (needed by NS)
    newton_schulz_steps: int | None = 0  # 0: plain update (Titans); 5: Mela eq. 10 (needs gates="chunk")
    step_scale: float | None = 1.0  # learning rate on the chunk step: M = (1-alpha) M + step_scale NS(S) (gates="chunk")
    conv_kernel: int = 4  # causal depthwise conv after the q/k/v projections; 0 = none
    value_silu: bool = True
    output_norm: bool = True
    output_gate: bool = True
    kernel_backend: str = "auto"  # kernels.memory_update backend: auto / triton / torch / compiled (UpdateRule)
    compiled_chunk_step: bool = False  # torch.compile each chunk step (CPU fast path; two graphs per new shape)
    checkpoint_chunks: int = 0  # recompute groups of this many chunks in backward; 0 = keep every chunk's tensors
    whole_sequence: bool = False  # all whole chunks of a call in one Triton launch forward, one backward (GPU)
    read_after_write: bool | None = False  # a chunk reads the state after its own write (Mela's HMM; whole chunks only)
    residual: bool = False  # M(x) = x + MLP(x) (docstring)
    output_proj: bool = True  # False: no output projection (needs n_heads * head_dim == dim)
    state_dtype: str | None = None  # None: float32 (float64 for float64 activations); e.g. "bfloat16" to measure
    qk_norm: bool = True
    learned_init: bool = True
    max_lr: float = 0.01
    max_update_norm: float | None = None  # bound on each chunk's mean surprise norm; None: `surprise_bound`; 0: off

    def __post_init__(self):
        if self.gates not in GATE_RULES:
            raise ValueError(f"neural memory gates '{self.gates}' unknown: choose one of {GATE_RULES}")
        if self.newton_schulz_steps and self.gates == "token":
            raise ValueError("Newton-Schulz momentum (newton_schulz_steps > 0) orthogonalises one step per chunk: "
                             "set gates='chunk' (or newton_schulz_steps=0)")
        if self.step_scale not in (None, 1.0) and self.gates != "chunk":
            raise ValueError(f"step_scale {self.step_scale} scales the one step per chunk: set gates='chunk' "
                             "(per-token updates take their step size from theta)")
        if self.conv_kernel < 0 or self.checkpoint_chunks < 0 or (self.max_update_norm or 0) < 0:
            raise ValueError("conv_kernel, checkpoint_chunks and max_update_norm must be >= 0")
        if not self.output_proj and None not in (self.n_heads, self.head_dim) and self.n_heads * self.head_dim != self.dim:
            raise ValueError(f"a memory without output projection reads n_heads * head_dim = "
                             f"{self.n_heads * self.head_dim} features: set it to dim {self.dim} or output_proj=True")

    def filled_by(self, owner: str, **values) -> "NeuralMemoryConfig":
        """This config with the fields its owner sets: a field left None takes the owner's
        value, one set to the same value passes, and a different explicit value is refused
        (ValueError naming the field and the owner), so an owner never overwrites a value
        given on the command line. The owner's stored config keeps its None fields (tyro
        rebuilds it from them), and the owner calls this where it builds or counts the memory."""
        for name, value in values.items():
            mine = getattr(self, name)
            if mine is not None and mine != value:
                raise ValueError(f"memory.{name} = {mine} conflicts with {owner}'s {value}: {owner} sets it; "
                                 f"leave memory.{name} unset and change {owner}'s own field")
        return dataclasses.replace(self, **values)

    @property
    def surprise_bound(self) -> float:
        """The bound in force (module docstring, `max_update_norm`): the field when set, else
        SURPRISE_BOUND for the plain-gradient rules and 0 with Newton-Schulz."""
        if self.max_update_norm is not None:
            return self.max_update_norm
        return 0.0 if self.newton_schulz_steps else SURPRISE_BOUND

    def unset_fields(self) -> list[str]:
        """The owner-settable fields still None (a memory cannot be built with any)."""
        return [name for name in OWNER_FIELDS if getattr(self, name) is None]

    def layer_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of each memory weight matrix, e.g. depth 2: [(d, e*d), (e*d, d)]."""
        if self.depth == 1:
            return [(self.head_dim, self.head_dim)]
        hidden = self.expansion * self.head_dim
        return [(self.head_dim, hidden)] + [(hidden, hidden)] * (self.depth - 2) + [(hidden, self.head_dim)]


class NeuralMemory(nn.Module):
    """Multi-head neural memory layer: x (B, T, dim) -> (y (B, T, dim), MemoryState)."""

    def __init__(self, cfg: NeuralMemoryConfig):
        super().__init__()
        if cfg.unset_fields():
            raise ValueError(f"NeuralMemoryConfig fields {cfg.unset_fields()} are unset: set them, or build the memory "
                             "through its owner's config (`filled_by`)")
        self.cfg = cfg
        self.last_stats: dict[str, torch.Tensor] = {}
        inner = cfg.n_heads * cfg.head_dim
        self.to_qkv = nn.Linear(cfg.dim, 3 * inner, bias=False)
        if cfg.conv_kernel:
            self.conv = nn.Conv1d(3 * inner, 3 * inner, cfg.conv_kernel, groups=3 * inner, bias=False)
        self.to_gates = nn.Linear(cfg.dim, 3 * cfg.n_heads)  # theta, eta, alpha logits
        if cfg.output_norm:
            self.out_norm = nn.RMSNorm(cfg.head_dim, eps=1e-6)
        if cfg.output_gate:
            self.to_out_gate = nn.Linear(cfg.dim, cfg.n_heads)
        if cfg.output_proj:
            self.out = nn.Linear(inner, cfg.dim, bias=False)
        initial = [torch.empty(cfg.n_heads, i, o) for i, o in cfg.layer_shapes()]
        if cfg.learned_init:
            self.initial_weights = nn.ParameterList(nn.Parameter(w) for w in initial)
        else:
            for i, w in enumerate(initial):
                self.register_buffer(f"initial_weight_{i}", w)
        self.reset_parameters()

    def initial(self) -> list[torch.Tensor]:
        if self.cfg.learned_init:
            return list(self.initial_weights)
        return [getattr(self, f"initial_weight_{i}") for i in range(self.cfg.depth)]

    def reset_parameters(self) -> None:
        std = 0.02
        with torch.no_grad():
            for linear in (self.to_qkv, getattr(self, "out", None), self.to_gates):
                if linear is not None:  # the draw order of the configs with an output projection is kept
                    nn.init.normal_(linear.weight, std=std)
            nn.init.zeros_(self.to_gates.bias)  # theta = max_lr / 2, eta = 0.5 at first
            if self.cfg.conv_kernel:
                self.conv.reset_parameters()
            if self.cfg.output_norm:
                self.out_norm.reset_parameters()
            if self.cfg.output_gate:
                nn.init.normal_(self.to_out_gate.weight, std=std)
                nn.init.zeros_(self.to_out_gate.bias)
            for w in self.initial():
                nn.init.normal_(w, std=w.shape[-2] ** -0.5)

    def state_dtype(self, activation_dtype: torch.dtype) -> torch.dtype:
        """float32, float64 for float64 activations, or the forced `cfg.state_dtype`."""
        if self.cfg.state_dtype is not None:
            return getattr(torch, self.cfg.state_dtype)
        return torch.float64 if activation_dtype == torch.float64 else torch.float32

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, T, n head_dim) -> (B, n, T, head_dim): heads of one map (n = H) or of several side by side."""
        return t.unflatten(-1, (-1, self.cfg.head_dim)).transpose(1, 2)

    def empty_state(self, batch: int, device=None, dtype: torch.dtype = torch.float32) -> MemoryState:
        """A fresh stream for activations of `dtype`: the initial weights in the state dtype, zero
        momenta, both views of one stack per matrix (`MemoryState.stacked`)."""
        state_dtype = self.state_dtype(dtype)
        weights = tuple(w.to(state_dtype).expand(batch, *w.shape) for w in self.initial())
        h, d = self.cfg.n_heads, self.cfg.head_dim
        like = weights[0]
        pending = (like.new_zeros(batch, h, 0, d), like.new_zeros(batch, h, 0, d)) + tuple(
            like.new_zeros(batch, h, 0) for _ in range(3)
        )
        conv = torch.zeros(batch, max(self.cfg.conv_kernel - 1, 0), 3 * h * d, device=like.device, dtype=dtype)
        return stacked_state(tuple(torch.stack((w, torch.zeros_like(w)), 2) for w in weights), pending, conv)

    def _convolve(self, projected: torch.Tensor, history: torch.Tensor, channels: slice):
        """Causal depthwise conv of projected (B, T, c) after history (B, K-1, c) over the
        conv's `channels`. Returns (conved (B, T, c), the last K-1 inputs). Traced by
        torch.compile it is written as K shifted products (pointwise: they fuse with the ops
        around them, where a depthwise convolution is a kernel of its own); eagerly, one conv1d."""
        kernel = self.cfg.conv_kernel
        if not kernel:
            return projected, history
        padded = torch.cat([history.to(projected.dtype), projected], 1)
        rest = padded[:, padded.shape[1] - (kernel - 1):]
        if compiling():
            weight, length = self.conv.weight[channels, 0], projected.shape[1]
            conved = sum(padded[:, j : j + length] * weight[:, j] for j in range(kernel))
            return conved.to(projected.dtype), rest
        conved = F.conv1d(padded.transpose(1, 2), self.conv.weight[channels], groups=projected.shape[-1])
        return conved.transpose(1, 2), rest

    def _query_heads(self, q: torch.Tensor) -> torch.Tensor:
        """Queries or keys (B, T, n H d) of n maps side by side -> (B, n H, T, d): heads, then the
        SiLU and L2 norm of `qk_norm` (one reduction and one scale for all n: the write passes
        its queries and keys together)."""
        q = self._heads(q)
        return F.normalize(F.silu(q), dim=-1) if self.cfg.qk_norm else q

    def output_gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """The output gate from the memory's input x (B, T, dim): (B, H, T, 1), None without one."""
        return torch.sigmoid(self.to_out_gate(x)).transpose(1, 2)[..., None] if self.cfg.output_gate else None

    def output_heads(self, y: torch.Tensor, dtype: torch.dtype, gate: torch.Tensor | None) -> torch.Tensor:
        """Read y (B, H, T, d) -> (B, T, H * d) in `dtype`: per-head norm, then `gate`
        (`output_gate`, or None), before the output projection."""
        y = y.to(dtype)
        if self.cfg.output_norm:
            y = self.out_norm(y)
        if gate is not None:
            y = y * gate
        return y.transpose(1, 2).flatten(-2)

    def _output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Read y (B, H, T, d) -> (B, T, dim): per-head norm, gate from the input x, projection."""
        y = self.output_heads(y, x.dtype, self.output_gate(x))
        return self.out(y) if self.cfg.output_proj else y

    def read_queries(self, x: torch.Tensor, segment: int | None = None) -> torch.Tensor:
        """Read-only queries of x (B, T, dim) -> (B, H, T, d): projection, conv, norm. The
        conv starts from zero history at each call, or at every `segment` tokens when given
        (as one call per segment would)."""
        inner = self.cfg.n_heads * self.cfg.head_dim
        q = F.linear(x, self.to_qkv.weight[:inner])
        length = q.shape[1]
        if segment is not None and length > segment:  # one row per segment, zero-padded to whole segments
            q = F.pad(q, (0, 0, 0, -length % segment)).unflatten(1, (-1, segment)).flatten(0, 1)
        q, _ = self._convolve(q, q.new_zeros(q.shape[0], max(self.cfg.conv_kernel - 1, 0), inner), slice(0, inner))
        q = q.reshape(x.shape[0], -1, inner)[:, :length]
        return self._query_heads(q)

    def read(self, q: torch.Tensor, state: MemoryState) -> torch.Tensor:
        """M*(q) with the state's current weights (thesis eq. 2.41): q (B, H, T, d) -> (B, H, T, d)
        in the state dtype."""
        return mlp_forward(state.weights, q.to(state.weights[0].dtype), self.cfg.residual)[0]

    def retrieve(self, x: torch.Tensor, state: MemoryState) -> torch.Tensor:
        """Read without writing: M*(q_t) with the state's current weights (thesis eq. 2.41).
        The queries' conv starts from zero history at each call (module docstring)."""
        return self._output(self.read(self.read_queries(x), state), x)

    def _gates(self, logits: torch.Tensor):
        """Gate logits (B, T, 3 H) (`to_gates`) -> theta, log eta, log(1 - alpha), each (B, H, T),
        in float32 at least."""
        cfg = self.cfg
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).transpose(1, 2).unflatten(1, (3, cfg.n_heads))
        theta_logit, eta_logit, alpha_logit = logits.unbind(1)
        theta = cfg.max_lr * torch.sigmoid(theta_logit)
        log_eta = F.logsigmoid(eta_logit) if cfg.momentum else torch.full_like(eta_logit, float("-inf"))
        log_keep = F.logsigmoid(-(alpha_logit + FORGET_LOGIT_OFFSET)) if cfg.forget else torch.zeros_like(alpha_logit)
        return theta, log_eta, log_keep

    def write(self, qkv: torch.Tensor, gate_logits: torch.Tensor, state: MemoryState,
              gate_bias: torch.Tensor | None = None):
        """Write a stream and read it (the chunk rule of `chunked_memory`) from its projections:
        qkv (B, T, 3 H d) (`to_qkv`) and gate_logits (B, T, 3 H) (`to_gates`; without its bias when
        `gate_bias` is given, which is then added here or by the prepared path). Returns the reads
        y (B, H, T, d) in the state dtype, before `_output`, and the new state. Where
        `_prepares_inputs` allows, the inputs between the projections and the whole-sequence
        kernels are prepared in one launch (`_prepared_write`)."""
        if self._prepares_inputs(qkv.shape[1], state):
            written = self._prepared_write(qkv, gate_logits, state, gate_bias)
            if written is not None:
                return written
        if gate_bias is not None:
            gate_logits = (gate_logits + gate_bias).to(gate_logits.dtype)
        cfg = self.cfg
        qkv, conv = self._convolve(qkv, state.conv, slice(None))
        qk, v = qkv.split([2 * cfg.n_heads * cfg.head_dim, cfg.n_heads * cfg.head_dim], -1)
        (q, k), v = self._query_heads(qk).chunk(2, 1), self._heads(v)
        if cfg.value_silu:
            v = F.silu(v)
        dtype, start_weights = state.weights[0].dtype, state.weights
        new = (k.to(dtype), v.to(dtype), *(g.to(dtype) for g in self._gates(gate_logits)))
        stream = [torch.cat([p, n], 2) for p, n in zip(state.pending, new)]
        y, state, clipped_share = chunked_memory(state, q.to(dtype), *stream, cfg.chunk_size, self._rule(),
                                                 cfg.compiled_chunk_step, cfg.checkpoint_chunks)
        if recording_on():
            self._note_stats(start_weights, state, new[2:], clipped_share)
        return y, MemoryState(*state[:3], conv, state.stacked)  # the constructor, not _replace (MemoryState)

    def _rule(self) -> UpdateRule:
        cfg = self.cfg
        return UpdateRule(cfg.gates, cfg.newton_schulz_steps, cfg.kernel_backend, cfg.read_after_write, cfg.step_scale,
                          cfg.residual, cfg.surprise_bound, cfg.whole_sequence)

    def projection_groups(self) -> tuple[tuple[nn.Linear, ...], ...]:
        """The linear maps `forward` projects together: q/k/v and the gates."""
        return ((self.to_qkv, self.to_gates),)

    def forward(self, x: torch.Tensor, state: MemoryState | None = None):
        """x (B, T, dim) written and read from `state` (None: fresh) -> (y (B, T, dim), new state).
        Traced by torch.compile, the two input projections run as one matmul (`project_together`);
        where the inputs are prepared in one launch (`_prepares_inputs`), the gates' bias is left to it."""
        if state is None:
            state = self.empty_state(x.shape[0], device=x.device, dtype=x.dtype)
        (linears,) = self.projection_groups()
        prepares = self._prepares_inputs(x.shape[1], state)
        qkv, gate_logits = project_together(x, linears, biases=not prepares)
        y, state = self.write(qkv, gate_logits, state, self.to_gates.bias if prepares else None)
        return self._output(y, x), state

    def _prepares_inputs(self, length: int, state: MemoryState) -> bool:
        """Whether a call of `length` tokens may prepare its inputs with `kernels.memory_inputs`
        (one launch where `write` takes eleven to seventeen under Inductor): the whole-sequence
        path, whole chunks and nothing pending, plain projections and conv, and no diagnostics
        recorded (they read the per-token gates)."""
        cfg = self.cfg
        return (cfg.whole_sequence and not recording_on() and length > 0 and length % cfg.chunk_size == 0
                and state.pending[0].shape[2] == 0 and type(self.to_qkv) is nn.Linear
                and self.to_qkv.bias is None and type(self.to_gates) is nn.Linear
                and (not cfg.conv_kernel or type(self.conv) is nn.Conv1d))

    def _prepared_write(self, qkv: torch.Tensor, gate_logits: torch.Tensor, state: MemoryState,
                        gate_bias: torch.Tensor | None):
        """`write` for a call `_prepares_inputs` allows, from the projections (qkv (B, T, 3 H d),
        gate_logits (B, T, 3 H), without `gate_bias` where it is given), its inputs from
        `kernels.memory_inputs.chunk_inputs` (the same values: tests/test_memory_inputs.py); the
        conv's history becomes the call's last K - 1 projections, as `_convolve` leaves it. Returns
        (y (B, H, T, d), new state), or None where the kernel or the whole-sequence kernels cannot
        take it (then `write` runs on the same projections)."""
        cfg = self.cfg
        conv = (self.conv.weight, state.conv) if cfg.conv_kernel else (None, None)
        if memory_inputs_refusal(qkv, gate_logits, cfg.n_heads, cfg.chunk_size, cfg.gates, *conv) is not None:
            return None
        q, k, v, token_weights, decays = chunk_inputs(
            qkv, gate_logits, gate_bias, cfg.n_heads, cfg.chunk_size, cfg.max_lr, FORGET_LOGIT_OFFSET,
            cfg.qk_norm, cfg.value_silu, cfg.momentum, cfg.forget, cfg.gates, *conv)
        written = whole_chunks_memory(state, q, k, v, token_weights, decays, self._rule(), cfg.checkpoint_chunks)
        if written is None:
            return None
        y, new = written[:2]
        history = state.conv
        if cfg.conv_kernel:
            taps = cfg.conv_kernel - 1
            history = qkv[:, qkv.shape[1] - taps :] if qkv.shape[1] >= taps else \
                torch.cat([history.to(qkv.dtype), qkv], 1)[:, -taps:]
        return y, MemoryState(*new[:3], history, new.stacked)

    def _note_stats(self, start_weights, state: MemoryState, gates, clipped_share: torch.Tensor | None) -> None:
        """Diagnostics of the last forward recorded (`models.layers.diagnostics.recording`; detached
        scalars): Frobenius norms over all fast weights / momenta, the update-to-weight ratio
        ||M_end - M_start|| / ||M_start||, the means of theta, eta and alpha over the new tokens,
        and with `max_update_norm` the share of surprise sums it clipped."""
        with torch.no_grad():
            def norm(tensors):
                return torch.stack([t.float().norm() for t in tensors]).norm()

            start = norm(start_weights)
            theta, log_eta, log_keep = gates
            self.last_stats = {
                "weight_norm": norm(state.weights), "momentum_norm": norm(state.momentum),
                "update_ratio": norm([a - b for a, b in zip(state.weights, start_weights)]) / start.clamp_min(1e-12),
                "theta_mean": theta.mean(), "eta_mean": log_eta.exp().mean(), "alpha_mean": 1 - log_keep.exp().mean(),
            }
            if clipped_share is not None:
                self.last_stats["clipped_share"] = clipped_share


def use_whole_sequence(model: nn.Module, enabled: bool = True) -> int:
    """Switch every `NeuralMemory` of `model` onto the whole-sequence path (`enabled`) or off
    it, as `NeuralMemoryConfig.whole_sequence` would have built it (each keeps its surprise
    bound: the kernels apply it). Returns how many were switched."""
    memories = [m for m in model.modules() if isinstance(m, NeuralMemory)]
    for memory in memories:
        memory.cfg = dataclasses.replace(memory.cfg, whole_sequence=enabled)
    return len(memories)
