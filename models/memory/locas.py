"""Locas: sideways-FFN parametric memories written at test time (Lu et al., "Locas: Your Models
are Principled Initializers of Locally-Supported Parametric Memories", 2026; paper 000).

A Locas memory sits beside a block's FFN, reads the FFN's input A (..., d) and adds to its
output (figure 2): H_out = FFN(A) + tau * Locas(A). Two variants (section 2.2):

- **Locas-GLU** (on Llama / Qwen3's SwiGLU FFN): Locas(A) = V^T (SiLU(G^T A) * K^T A) with
  gate G, key K, value V of width r, stored as rows (r, d). Initialised from the first chunk
  of the text to memorise (section 2.4): every FFN channel j scored by its mean activation
  magnitude alpha_j = mean_t |SiLU(W_G A_t)_j (W_K A_t)_j| over the chunk, the top-r
  channels' gate and up rows cloned, row-normalised, as G and K; V = 0 (the model then equals
  the backbone exactly); tau = (1 / r) * mean_j ||W_down[j, :]|| (the down projection's
  columns in torch's (d, m) layout). The ablation's other inits (Table 2): "bottomk", "random_select"
  (clone r channels chosen uniformly), "gaussian" (G, K rows drawn N(0, I) then normalised: our
  choice of scale, the same unit norm as the clones) and "norm_act" (G = K = the normalised
  FFN inputs of r tokens evenly spaced through the chunk: Locas-MLP's key rule). After every
  update each row of G, K and V is clipped to norm <= 1 (`clip_`, w / max(||w||, 1)).
- **Locas-MLP** (on the MLP-FFN LM's two-layer FFN): Locas(A) = V^T act(K^T A), act the FFN's
  own activation (ReLU in the paper and by default; using the FFN's keeps the merge exact),
  tau = 1. Slots grow per token (section 2.3): key = A_t / ||A_t||, value = eps *
  G_t / ||G_t||_global, G_t a log-likelihood gradient with respect to the FFN's output at
  token t, normalised over the hidden size and all layers together (`grow_mlp_memories`).
  Which log-likelihood is `gradient`: "token" is the paper's G_t = grad log p(x_t | x_<t)
  (sections 2.3, A.1.6), token t's own term alone (one batched backward per group of
  `TOKEN_GRADIENT_BATCH` tokens, the diagonal of the chunk's Jacobian); "chunk" (default, one
  backward per chunk, our cheaper choice) the gradient of the whole chunk's log-likelihood
  at position t, which adds the terms of later tokens that attend to it. Both take the
  gradients of one chunk with the memory as it was before the chunk (A.1.6 grows token by
  token; the paper is silent on batching). With `update="nlsvd"`
  a memory holding N_cap = 2r slots is compressed by NL-SVD to r (appendix A.1.6,
  `models/memory/nl_svd.py`), so it never holds more than 2r; with `update="bp"` (the paper's
  recommended variant, Table 1) the memory has r slots, grown once from the first chunk
  (its r tokens of largest raw global gradient norm ||G_t||_global, taken before the
  normalisation that makes every value's global norm eps: our choice) and then trained by
  back-propagation like Locas-GLU.

`attach_locas` puts a memory beside the chosen blocks' FFNs (`SidewaysFFN`) and freezes
everything else (the "locas" row of models/grafts/graft.py's graft table, attached at test
time, with `locas_flops` its FLOP count); `merge_locas` folds the memories into the FFNs
(appended channels; layers with narrower memories padded with zero channels, act(0) = 0
keeping them exact) so the model needs no Locas code. Extra parameters: 3 L d r (GLU), 2 L d r (MLP; NL-SVD holds up to 2r
between compressions).

Shapes: A (..., d); memories' rows (r, d); fast weights kept in float32.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.flops import linear
from models.layers.graft_layers import graft_layers
from models.layers.ffn import SwiGLU
from models.memory.nl_svd import compress_if_full

VARIANTS = ("glu", "mlp")
GLU_INITS = ("topk", "bottomk", "random_select", "gaussian", "norm_act")
MLP_UPDATES = ("bp", "nlsvd")
MLP_GRADIENTS = ("chunk", "token")
TOKEN_GRADIENT_BATCH = 64  # tokens whose per-token gradients one batched backward computes


@dataclass
class LocasConfig:
    variant: str = "glu"  # "glu" (SwiGLU FFNs: Llama / Qwen3) | "mlp" (two-layer FFNs: the MLP-FFN LM)
    rank: int = 64  # r: the memory's width (Locas-MLP + NL-SVD: compressed to r from 2r)
    layers: str = "all"  # which blocks get a memory (models/layers/graft_layers.py's specs)
    init: str = "topk"  # Locas-GLU: one of GLU_INITS (Table 2)
    update: str = "bp"  # Locas-MLP: "bp" | "nlsvd"
    value_scale: float = 1.0  # Locas-MLP: eps of the value init (section 2.3)
    gradient: str = "chunk"  # Locas-MLP: G_t of the chunk's log-likelihood | "token": of log p(x_t | x_<t) (A.1.6)
    seed: int = 0  # random_select / gaussian draws

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"Locas variant '{self.variant}' unknown: choose one of {VARIANTS}")
        if self.init not in GLU_INITS:
            raise ValueError(f"Locas init '{self.init}' unknown: choose one of {GLU_INITS}")
        if self.update not in MLP_UPDATES:
            raise ValueError(f"Locas-MLP update '{self.update}' unknown: choose one of {MLP_UPDATES}")
        if self.gradient not in MLP_GRADIENTS:
            raise ValueError(f"Locas-MLP gradient '{self.gradient}' unknown: choose one of {MLP_GRADIENTS}")
        if self.rank < 1:
            raise ValueError(f"Locas rank must be at least 1, got {self.rank}")


def normalize_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row of x (n, d) divided by its norm (zero rows stay zero)."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def evenly_spaced(count: int, n: int) -> torch.Tensor:
    """`n` indices spread evenly over range(count) (n <= count)."""
    return torch.linspace(0, count - 1, n).round().long()


class LocasGLU(nn.Module):
    """Locas-GLU memory of width r beside a SwiGLU FFN of width m (module docstring)."""

    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.memory_gate = nn.Parameter(torch.zeros(rank, dim))
        self.memory_key = nn.Parameter(torch.zeros(rank, dim))
        self.memory_value = nn.Parameter(torch.zeros(rank, dim))
        self.register_buffer("tau", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., d) -> tau * V^T (SiLU(G^T x) * K^T x), (..., d); computed in the memory's dtype."""
        h = x.to(self.memory_key.dtype)
        out = self.tau * ((F.silu(h @ self.memory_gate.T) * (h @ self.memory_key.T)) @ self.memory_value)
        return out.to(x.dtype)

    @torch.no_grad()
    def init_from_chunk(self, ffn: SwiGLU, inputs: torch.Tensor, strategy: str, generator: torch.Generator) -> None:
        """Section 2.4: inputs (N, d) = the FFN's inputs over the first chunk. Sets G, K (by
        `strategy`), V = 0 and tau = mean down-projection row norm / r."""
        rank = self.memory_key.shape[0]
        gate_rows, up_rows = ffn.w1.weight.float(), ffn.w3.weight.float()
        if strategy in ("topk", "bottomk", "random_select"):
            channels = self.select_channels(ffn, inputs, strategy, generator)
            gate, key = gate_rows[channels], up_rows[channels]
        elif strategy == "gaussian":
            gate, key = (torch.randn(rank, gate_rows.shape[1], generator=generator) for _ in range(2))
        else:  # norm_act
            gate = key = inputs.float()[evenly_spaced(len(inputs), rank).to(inputs.device)]
        self.memory_gate.copy_(normalize_rows(gate))
        self.memory_key.copy_(normalize_rows(key))
        self.memory_value.zero_()
        self.tau.copy_(ffn.w2.weight.float().norm(dim=0).mean() / rank)

    def select_channels(self, ffn: SwiGLU, inputs: torch.Tensor, strategy: str, generator: torch.Generator):
        """The r FFN channels to clone: top-r / bottom-r by activation importance
        alpha_j = mean_t |SiLU(W_G A_t)_j (W_K A_t)_j| (section 2.4), or r drawn uniformly."""
        rank, m = self.memory_key.shape[0], ffn.w1.weight.shape[0]
        if strategy == "random_select":
            return torch.randperm(m, generator=generator)[:rank]
        importance = channel_importance(ffn, inputs)
        return importance.topk(rank, largest=strategy == "topk").indices

    @torch.no_grad()
    def clip_(self) -> None:
        """Weight-norm clipping (section 2.4): every row w of G, K, V becomes w / max(||w||, 1)."""
        for weight in (self.memory_gate, self.memory_key, self.memory_value):
            weight.div_(weight.norm(dim=-1, keepdim=True).clamp_min(1.0))

    def merged_into(self, ffn: SwiGLU) -> SwiGLU:
        """A SwiGLU of width m + r equal to ffn(x) + self(x): G, K appended to W_1, W_3 and
        tau V^T to W_2's columns."""
        rank, dim = self.memory_key.shape
        merged = SwiGLU(dim, ffn.w1.weight.shape[0] + rank).to(ffn.w1.weight)
        with torch.no_grad():
            merged.w1.weight.copy_(torch.cat([ffn.w1.weight, self.memory_gate.to(ffn.w1.weight)]))
            merged.w3.weight.copy_(torch.cat([ffn.w3.weight, self.memory_key.to(ffn.w3.weight)]))
            merged.w2.weight.copy_(torch.cat([ffn.w2.weight, (self.tau * self.memory_value).T.to(ffn.w2.weight)], 1))
        return merged


def channel_importance(ffn: SwiGLU, inputs: torch.Tensor) -> torch.Tensor:
    """alpha (m,): mean over the N inputs (N, d) of |SiLU(W_G A) * W_K A| per FFN channel."""
    return (F.silu(ffn.w1(inputs)) * ffn.w3(inputs)).abs().float().mean(0)


class LocasMLP(nn.Module):
    """Locas-MLP memory: slots (keys, values) rows (n, d), n growing per token (module docstring)."""

    def __init__(self, dim: int, act):
        super().__init__()
        self.act = act
        self.memory_key = nn.Parameter(torch.zeros(0, dim))
        self.memory_value = nn.Parameter(torch.zeros(0, dim))

    @property
    def slots(self) -> int:
        return self.memory_key.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., d) -> act(x K^T) V, (..., d)."""
        h = x.to(self.memory_key.dtype)
        return (self.act(h @ self.memory_key.T) @ self.memory_value).to(x.dtype)

    @torch.no_grad()
    def set_slots(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the slots with keys, values (n, d) (new Parameters: the count changes)."""
        self.memory_key = nn.Parameter(keys.to(self.memory_key), requires_grad=self.memory_key.requires_grad)
        self.memory_value = nn.Parameter(values.to(self.memory_value), requires_grad=self.memory_value.requires_grad)

    def append(self, keys: torch.Tensor, values: torch.Tensor, capacity: int | None) -> None:
        """Add slots (n, d) one by one in order; with `capacity`, NL-SVD compresses the memory
        to capacity // 2 slots whenever it holds `capacity` (appendix A.1.6), so it never
        holds more."""
        start = 0
        while start < len(keys):
            room = len(keys) - start if capacity is None else capacity - self.slots
            end = start + room
            self.set_slots(torch.cat([self.memory_key.detach(), keys[start:end]]),
                           torch.cat([self.memory_value.detach(), values[start:end]]))
            if capacity is not None:
                self.set_slots(*compress_if_full(self.memory_key.detach(), self.memory_value.detach(), capacity, self.act))
            start = end

    def merged_into(self, ffn: nn.Module) -> nn.Module:
        """The two-layer FFN with the slots appended: W_1 rows += K, W_2 columns += V^T."""
        merged = copy.deepcopy(ffn)
        merged.w1 = nn.Linear(ffn.w1.in_features, ffn.w1.out_features + self.slots, bias=False).to(ffn.w1.weight)
        merged.w2 = nn.Linear(ffn.w2.in_features + self.slots, ffn.w2.out_features, bias=False).to(ffn.w2.weight)
        with torch.no_grad():
            merged.w1.weight.copy_(torch.cat([ffn.w1.weight, self.memory_key.to(ffn.w1.weight)]))
            merged.w2.weight.copy_(torch.cat([ffn.w2.weight, self.memory_value.T.to(ffn.w2.weight)], 1))
        return merged


class SidewaysFFN(nn.Module):
    """A block's FFN with a Locas memory beside it: ffn(A) + memory(A) (figure 2). With
    `recording` set, keeps the last call's input A and output, still in the autograd graph
    (for initialisation and Locas-MLP's gradient-guided growth)."""

    def __init__(self, ffn: nn.Module, memory: nn.Module):
        super().__init__()
        self.ffn, self.memory = ffn, memory
        self.recording = False
        self.inputs = self.outputs = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ffn(x) + self.memory(x)
        if self.recording:
            self.inputs = x.detach()
            self.outputs = out
        return out


def ffn_width(ffn: nn.Module) -> int:
    return ffn.w1.weight.shape[0]


def check_ffn(ffn: nn.Module, cfg: LocasConfig, layer: int) -> None:
    """ValueError naming the block when its FFN is not the kind the variant extends or is
    narrower than the memory."""
    is_glu = isinstance(ffn, SwiGLU)
    is_mlp = not is_glu and hasattr(ffn, "w1") and hasattr(ffn, "w2") and hasattr(ffn, "act")
    if cfg.variant == "glu" and not is_glu:
        raise ValueError(f"Locas-GLU needs a SwiGLU FFN (w1, w3, w2) in block {layer}, which has "
                         f"{type(ffn).__name__}: use Locas variant 'mlp' on two-layer MLP FFNs")
    if cfg.variant == "mlp" and not is_mlp:
        raise ValueError(f"Locas-MLP needs a two-layer MLP FFN (w1, act, w2) in block {layer}, which has "
                         f"{type(ffn).__name__}: use Locas variant 'glu' on SwiGLU FFNs")
    if cfg.rank > ffn_width(ffn):
        raise ValueError(f"Locas rank {cfg.rank} exceeds the FFN width {ffn_width(ffn)} of block {layer}: "
                         f"choose a rank of at most {ffn_width(ffn)}")


def attach_locas(model: nn.Module, cfg: LocasConfig) -> list[SidewaysFFN]:
    """Put a fresh memory (float32) beside the FFN of each block `cfg.layers` names in
    `model` (a DecoderLM or MLPLM: `model.layers` of blocks with `feed_forward`), freeze every
    other parameter, and return the SidewaysFFNs in block order. ValueError (nothing changed)
    on an FFN of another kind or narrower than r."""
    blocks = list(model.layers.values())
    chosen = graft_layers(cfg.layers, len(blocks))
    for i in chosen:
        check_ffn(blocks[i].feed_forward, cfg, i)
    for p in model.parameters():
        p.requires_grad_(False)
    sideways = []
    for i in chosen:
        ffn = blocks[i].feed_forward
        dim = ffn.w1.weight.shape[1]
        memory = LocasGLU(dim, cfg.rank) if cfg.variant == "glu" else LocasMLP(dim, ffn.act)
        blocks[i].feed_forward = SidewaysFFN(ffn, memory.to(ffn.w1.weight.device))
        sideways.append(blocks[i].feed_forward)
    return sideways


def memory_parameters(sideways: list[SidewaysFFN]) -> list[nn.Parameter]:
    return [p for s in sideways for p in s.memory.parameters()]


def extra_parameters(cfg: LocasConfig, n_layers: int, dim: int) -> int:
    """The paper's count (section 3.3.2): 3 L d r for Locas-GLU, 2 L d r for Locas-MLP."""
    return (3 if cfg.variant == "glu" else 2) * len(graft_layers(cfg.layers, n_layers)) * dim * cfg.rank


def locas_flops(cfg: LocasConfig, n_layers: int, dim: int) -> float:
    """Forward matmul FLOPs per token the memories add to the model they are attached to, at
    their widest (models/layers/flops.py): per memory block, Locas-GLU's G, K, V (3 products
    of d x r), Locas-MLP's K, V over its slots (2 products of d x n; n at most r with "bp",
    2r with "nlsvd", which compresses at 2r)."""
    if cfg.variant == "glu":
        per_block = 3 * linear(dim, cfg.rank)
    else:
        per_block = 2 * linear(dim, (2 if cfg.update == "nlsvd" else 1) * cfg.rank)
    return len(graft_layers(cfg.layers, n_layers)) * per_block


@torch.no_grad()
def init_glu_memories(sideways: list[SidewaysFFN], cfg: LocasConfig) -> None:
    """Initialise every Locas-GLU memory from its recorded chunk inputs (the FFN inputs of
    the last forward with `recording` on), by `cfg.init`."""
    generator = torch.Generator().manual_seed(cfg.seed)
    for s in sideways:
        s.memory.init_from_chunk(s.ffn, s.inputs.flatten(0, -2), cfg.init, generator)
        s.inputs = s.outputs = None


def ffn_output_gradients(sideways: list[SidewaysFFN], nll: torch.Tensor, targets: slice,
                         per_token: bool) -> list[torch.Tensor]:
    """G (n, d) per layer, float32: the log-likelihood's gradient at each FFN output (the
    recorded forward's `outputs`, (1, L, d)) at the n positions `targets` that predict the n
    scored tokens, whose NLL (n,) is `nll` (in the same graph). per_token: row j is
    grad log p(x_j | x_<j) alone (the paper's G_t, A.1.6), from batched backwards over groups
    of TOKEN_GRADIENT_BATCH one-hot weightings of the NLL; else row j is the gradient of the
    whole chunk's log-likelihood -sum_j NLL_j at position j (one backward)."""
    outputs = [s.outputs for s in sideways]
    if not per_token:
        return [g[0, targets].float() for g in torch.autograd.grad(-nll.sum(), outputs)]
    positions = torch.arange(targets.start, targets.stop, device=nll.device)
    picks = torch.eye(len(nll), dtype=nll.dtype, device=nll.device)
    rows = [[] for _ in outputs]
    for start in range(0, len(nll), TOKEN_GRADIENT_BATCH):
        group = picks[start : start + TOKEN_GRADIENT_BATCH]
        grads = torch.autograd.grad(-nll, outputs, grad_outputs=group, is_grads_batched=True, retain_graph=True)
        diagonal = (torch.arange(len(group), device=nll.device), 0, positions[start : start + len(group)])
        for row, g in zip(rows, grads):
            row.append(g[diagonal].float())
    return [torch.cat(row) for row in rows]


@torch.no_grad()
def mlp_slots(sideways: list[SidewaysFFN], grads: list[torch.Tensor], targets: slice,
              value_scale: float) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Section 2.3's slot init per layer from the last recorded forward and the gradients G
    (n, d) per layer (`ffn_output_gradients`): keys = A_t / ||A_t||, values = eps * G_t /
    ||G_t||_global, normalised over the hidden size and every layer together; over the token
    positions `targets` of the row. -> ([(keys, values) (n, d)] per layer, ||G_t||_global (n,)
    before normalisation)."""
    global_norm = torch.stack([g.pow(2).sum(-1) for g in grads]).sum(0).sqrt()
    scale = value_scale / global_norm.clamp_min(1e-12)[:, None]
    return [(normalize_rows(s.inputs[0, targets].float()), g * scale) for s, g in zip(sideways, grads)], global_norm


def grow_mlp_memories(sideways: list[SidewaysFFN], nll: torch.Tensor, targets: slice, cfg: LocasConfig,
                      first_chunk: bool) -> None:
    """Locas-MLP's expansion after a chunk whose NLL (n,) the recorded forward gave
    (`ffn_output_gradients` by `cfg.gradient`, `mlp_slots`): "nlsvd" appends a slot per token
    with NL-SVD compression at 2r slots; "bp" grows only from the first chunk, its r tokens
    of largest raw global gradient norm (all of them if fewer), the memory then trained by BP."""
    grads = ffn_output_gradients(sideways, nll, targets, cfg.gradient == "token")
    slots, grad_norm = mlp_slots(sideways, grads, targets, cfg.value_scale)
    if cfg.update == "nlsvd":
        for s, (keys, values) in zip(sideways, slots):
            s.memory.append(keys, values, 2 * cfg.rank)
    elif first_chunk:
        picked = grad_norm.topk(min(cfg.rank, len(grad_norm))).indices.sort().values
        for s, (keys, values) in zip(sideways, slots):
            s.memory.append(keys[picked], values[picked], None)


def pad_channels(ffn: nn.Module, width: int) -> nn.Module:
    """The FFN (SwiGLU or two-layer) widened to `width` channels with zero rows / columns:
    the same function, as act(0) = 0 for SiLU, ReLU and GELU."""
    extra = width - ffn_width(ffn)
    dim = ffn.w1.weight.shape[1]
    with torch.no_grad():
        zeros = torch.zeros(extra, dim).to(ffn.w1.weight)
        if isinstance(ffn, SwiGLU):
            padded = LocasGLU(dim, extra).to(zeros)
        else:
            padded = LocasMLP(dim, ffn.act).to(zeros)
            padded.set_slots(zeros, zeros)
        return padded.merged_into(ffn)


def merge_locas(model: nn.Module) -> nn.Module:
    """Fold every SidewaysFFN of `model` into a plain FFN of width m + r (`merged_into`),
    every block then padded with zero channels to the widest, and set the config's FFN width
    (DecoderLM `ffn_hidden`, MLPLM `ffn_dim`): a model that needs no Locas code and gives the
    same outputs. Returns the model (changed in place)."""
    import dataclasses

    blocks = list(model.layers.values())
    for block in blocks:
        if isinstance(block.feed_forward, SidewaysFFN):
            block.feed_forward = block.feed_forward.memory.merged_into(block.feed_forward.ffn)
    width = max(ffn_width(b.feed_forward) for b in blocks)
    for block in blocks:
        if ffn_width(block.feed_forward) < width:
            block.feed_forward = pad_channels(block.feed_forward, width)
    field = "ffn_hidden" if hasattr(model.cfg, "ffn_hidden") else "ffn_dim"
    model.cfg = dataclasses.replace(model.cfg, **{field: width})
    return model
