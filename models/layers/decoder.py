"""The project's pre-norm decoder in plain torch: RMSNorm, grouped-query self-attention with
RoPE, the block (x += Attn(norm x); x += FFN(norm x)) and the decoder-LM skeleton. Mela's
decoder and memory blocks (models/lms/mela.py), the MLP-FFN LM (models/lms/mlp_lm.py) and the
pretrained Llama / Qwen2 / Qwen3 backbone (models/backbones/decoder_lm.py) are built from them;
being torch only, they ship inside a Hugging Face export.

What differs between those models is a parameter:
- `rope`: "pairs" rotates consecutive pairs (x[2i], x[2i+1]), as torchtitan's ComplexRoPE,
  with angles in float64 (from-scratch models; exact in float64); "halves" rotates the two
  halves of each head together, as Hugging Face, with float32 angles from a non-persistent
  `inv_freq` buffer (Llama 3's frequency scaling optional), so pretrained checkpoints load
  without permuting q / k and match transformers' outputs (models/layers/rope.py).
- `hf_norm`: the RMSNorms round as transformers' (`RMSNorm`).
- `qkv_bias` (Qwen2), `qk_norm` (Qwen3: RMSNorm over each head of q and k before RoPE), an
  explicit `head_dim` (Qwen3), `gated` (an output gate: Mela's memory blocks).
- `ffn`: "swiglu" or a two-layer MLP with an element-wise activation (models/layers/ffn.py).

Parameter names follow torchtitan's unfused layout, so its AC / compile / FSDP2 helpers, the
Hugging Face key maps (torchtitan_ext/families/backbone.py), LoRA targets and grafts apply:
attention.{wq,wk,wv,wo,wg,q_norm,k_norm}, feed_forward.{w1,w2,w3}, attention_norm, ffn_norm;
tok_embeddings, layers.<i>, norm, lm_head. With the defaults the block is torchtitan's
`Llama3TransformerBlock` (tests/test_mela.py); tests/test_decoder.py holds both RoPE layouts
against a written-out block in float64.

Shapes: x (B, L, dim), positions (L,) or (B, L) -> (B, L, dim); tokens (B, L) -> logits (B, L, vocab_size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from models.layers.attention import document_causal_attention
from models.layers.ffn import feed_forward
from models.layers.diagnostics import recording_on
from models.layers.tracing import project_together
from models.layers.rope import apply_half_rope, apply_rope, rope_angles, rope_inv_freq

ROPE_LAYOUTS = ("pairs", "halves")


class RMSNorm(nn.RMSNorm):
    """weight * x / rms(x) over the last dim. x (..., dim) -> (..., dim).

    Both roundings take the statistics in float32 for lower-precision inputs (float64 stays
    float64) and agree in float32 up to rounding; they differ in where the result is cast back
    to the input dtype. `hf` False: torch's rms_norm kernel (nn.RMSNorm; a weight in the input's
    dtype is applied before the one cast). True: transformers' LlamaRMSNorm (as Meta's Llama code), the
    normalised x cast back before the weight multiplies it, so bf16 outputs round as those of
    the pretrained checkpoints' own code."""

    def __init__(self, dim: int, eps: float, hf: bool = False):
        super().__init__(dim, eps=eps)
        self.hf = hf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.hf:
            return super().forward(x)
        work = x if x.dtype == torch.float64 else x.float()
        work = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * work.to(x.dtype)


@dataclass
class AttentionConfig:
    """`Attention`'s shape and options (module docstring)."""

    dim: int
    n_heads: int
    n_kv_heads: int
    rope_theta: float
    head_dim: int | None = None  # default dim // n_heads
    rope: str = "pairs"  # ROPE_LAYOUTS
    rope_scaling: dict | None = None  # "halves": Llama 3's frequency scaling (models/layers/rope.py)
    qkv_bias: bool = False  # biases on W_q, W_k, W_v (W_o has none)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE
    norm_eps: float = 1e-6  # the q / k norms'
    hf_norm: bool = False  # the q / k norms round as transformers' (RMSNorm)
    gated: bool = False  # out * sigmoid(x W_g) before W_o (gated attention, Qiu et al. 2025)
    prefix_keys: int = 0  # > 0: the attention mass on the first prefix_keys keys (`last_prefix_mass`, when recorded)

    def __post_init__(self):
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"dim {self.dim} must divide by n_heads {self.n_heads} (or give head_dim)")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}")
        if self.rope not in ROPE_LAYOUTS:
            raise ValueError(f"RoPE layout '{self.rope}' unknown: choose one of {ROPE_LAYOUTS}")
        if self.rope_scaling and self.rope != "halves":
            raise ValueError("rope_scaling is Hugging Face's: it takes the RoPE layout 'halves'")


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE, inside packed documents. `project`,
    `project_kv` and `attend` are its steps, for blocks that attend over more than their input
    (a KV cache, memory tokens: models/grafts/*.py)."""

    DIAGNOSTIC_QUERIES = 64  # queries (the last of the sequence) whose attention mass on the prefix is recorded

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, rope_theta: float, **options):
        """options: the other fields of AttentionConfig."""
        super().__init__()
        cfg = self.cfg = AttentionConfig(dim, n_heads, n_kv_heads, rope_theta, **options)
        self.last_prefix_mass: torch.Tensor | None = None
        q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(dim, q_width, bias=cfg.qkv_bias)
        self.wk = nn.Linear(dim, kv_width, bias=cfg.qkv_bias)
        self.wv = nn.Linear(dim, kv_width, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q_width, dim, bias=False)
        self.wg = nn.Linear(dim, q_width, bias=False) if cfg.gated else None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.hf_norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.hf_norm) if cfg.qk_norm else None
        if cfg.rope == "halves":
            self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, rope_theta, cfg.rope_scaling),
                                 persistent=False)

    def reset_buffers(self, device: torch.device) -> None:
        """The "halves" RoPE frequencies (not in checkpoints), in float32 on `device`: after
        `to_empty`, or after a load that materialised them empty."""
        if self.cfg.rope == "halves":
            self.inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling).to(device)

    def _heads(self, t: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """(B, L, n * head_dim) -> (B, n, L, head_dim), each head normed first by `norm`."""
        t = t.unflatten(-1, (-1, self.cfg.head_dim))
        return (t if norm is None else norm(t)).transpose(1, 2)

    def _rope(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Heads t (B, n, L, head_dim) rotated by positions (L,) or (B, L), in the config's layout."""
        positions = positions.expand(t.shape[0], -1)
        if self.cfg.rope == "pairs":
            return apply_rope(t, *rope_angles(positions, self.cfg.head_dim, self.cfg.rope_theta))
        return apply_half_rope(t, positions, self.inv_freq)

    def _rotated_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Projections (B, L, n * head_dim) -> heads (B, n, L, head_dim), q / k normed and rotated."""
        return (self._rope(self._heads(q, self.q_norm), positions), self._rope(self._heads(k, self.k_norm), positions),
                self._heads(v))

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x (B, L, dim), positions (L,) or (B, L) -> q (B, n_heads, L, head_dim), k and v
        (B, n_kv_heads, L, head_dim): projected (`project_together`), q / k normed (`qk_norm`) and rotated."""
        return self._rotated_heads(*project_together(x, (self.wq, self.wk, self.wv)), positions)

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor):
        """x (B, L, dim), positions (L,) or (B, L) -> k, v (B, n_kv_heads, L, head_dim) as `project`'s."""
        return self._rope(self._heads(self.wk(x), self.k_norm), positions), self._heads(self.wv(x))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_positions: torch.Tensor | None,
               x: torch.Tensor | None = None, gate_logits: torch.Tensor | None = None) -> torch.Tensor:
        """Projected q (B, n_heads, Lq, head_dim) over k, v (B, n_kv_heads, Lk, head_dim), the
        queries being the last Lq of the Lk tokens; doc_positions (B, Lk) restarting at 0 per
        document, or None (one document per row); the output gate (`gated` only) reads
        gate_logits (B, Lq, n_heads * head_dim) = W_g x when given, else W_g of x (B, Lq, dim),
        the attention's input -> (B, Lq, dim)."""
        out = document_causal_attention(q, k, v, doc_positions).transpose(1, 2).flatten(-2)
        if self.wg is not None:
            out = out * torch.sigmoid(self.wg(x) if gate_logits is None else gate_logits)
        return self.wo(out)

    def projection_groups(self) -> tuple[tuple[nn.Linear, ...], ...]:
        """The linear maps `forward` projects together: q, k, v and the output gate's W_g."""
        return ((self.wq, self.wk, self.wv, *((self.wg,) if self.wg is not None else ())),)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, doc_positions: torch.Tensor | None = None):
        """x (B, L, dim); positions (L,) or (B, L) for RoPE; doc_positions (B, L) or None for masking.
        q, k, v and the output gate's W_g x are projected together (`project_together`)."""
        q, k, v, *gate_logits = project_together(x, self.projection_groups()[0])
        q, k, v = self._rotated_heads(q, k, v, positions)
        if self.cfg.prefix_keys and recording_on():
            self._note_prefix_mass(q, k)
        return self.attend(q, k, v, doc_positions, x, *gate_logits)

    def _note_prefix_mass(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Diagnostics: mean attention probability the last DIAGNOSTIC_QUERIES queries put on
        the first `prefix_keys` keys (Mela: its memory tokens). q (B, H, L, d), k (B, Hkv, L, d)."""
        with torch.no_grad():
            length = q.shape[2]
            first = max(length - self.DIAGNOSTIC_QUERIES, 0)
            keys = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
            scores = (q[:, :, first:] @ keys.transpose(-1, -2)).float() / math.sqrt(self.cfg.head_dim)
            rows = torch.arange(first, length, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(length, device=q.device)[None, :] > rows, float("-inf"))
            self.last_prefix_mass = scores.softmax(-1)[..., : self.cfg.prefix_keys].sum(-1).mean()


class DecoderBlock(nn.Module):
    """x + Attn(norm x), then + FFN(norm x)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, rope_theta: float, norm_eps: float,
                 *, ffn: str = "swiglu", hf_norm: bool = False, **attention):
        """ffn: models/layers/ffn.py's FFNS; hf_norm: every norm rounds as transformers'
        (RMSNorm); attention: the other fields of AttentionConfig."""
        super().__init__()
        self.attention_norm = RMSNorm(dim, norm_eps, hf_norm)
        self.attention = Attention(dim, n_heads, n_kv_heads, rope_theta, norm_eps=norm_eps, hf_norm=hf_norm,
                                   **attention)
        self.ffn_norm = RMSNorm(dim, norm_eps, hf_norm)
        self.feed_forward = feed_forward(dim, ffn_hidden, ffn)

    def reset_parameters(self, std: float, n_layers: int) -> None:
        """N(0, std) inputs, residual outputs (W_o, W_2) scaled by 1/sqrt(2 n_layers), biases
        to zero, norms to one."""
        attention, ffn = self.attention, self.feed_forward
        with torch.no_grad():
            inputs = (attention.wq, attention.wk, attention.wv, ffn.w1, getattr(ffn, "w3", None), attention.wg)
            for linear in (m for m in inputs if m is not None):
                nn.init.normal_(linear.weight, std=std)
                if linear.bias is not None:
                    nn.init.zeros_(linear.bias)
            for linear in (attention.wo, ffn.w2):
                nn.init.normal_(linear.weight, std=std / math.sqrt(2 * n_layers))
            for norm in (self.attention_norm, self.ffn_norm, attention.q_norm, attention.k_norm):
                if norm is not None:
                    norm.reset_parameters()

    def forward(self, x: torch.Tensor, positions: torch.Tensor, doc_positions: torch.Tensor | None = None):
        """x (B, L, dim); positions (L,) or (B, L) for RoPE; doc_positions (B, L) or None for masking."""
        x = x + self.attention(self.attention_norm(x), positions, doc_positions)
        return x + self.feed_forward(self.ffn_norm(x))

    def step(self, x: torch.Tensor, positions: torch.Tensor, cache: tuple | None):
        """The next tokens of a stream (one document per row): x (B, L, dim), positions (B, L)
        continuing the stream's; cache (keys, values) of the tokens before or None ->
        (output, cache with x's keys and values appended)."""
        xn = self.attention_norm(x)
        q, k, v = self.attention.project(xn, positions)
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        x = x + self.attention.attend(q, k, v, None, xn)
        return x + self.feed_forward(self.ffn_norm(x)), (k, v)

    @staticmethod
    def keep_last(cache: tuple, tokens: int) -> tuple:
        """A stream's cache (keys, values (B, n_kv_heads, S, head_dim)) cut to its last `tokens` tokens."""
        return tuple(t[:, :, max(t.shape[2] - tokens, 0):] for t in cache)


class DecoderLMBase(nn.Module):
    """A decoder LM's skeleton: token embeddings, `n_layers` DecoderBlocks, the last norm and
    the output head (tied to the embeddings under `tie_embeddings`). Subclasses set the
    blocks' options and initialise (`reset_parameters`). Documents packed in a row are kept
    apart through `positions` (restarting at 0 per document).

    cfg has vocab_size, dim, n_layers, n_heads, n_kv_heads (None: n_heads), rope_theta,
    norm_eps, tie_embeddings and max_seq_len."""

    # When True, forward returns the final hidden states (B, L, dim) and the caller applies
    # lm_head (torchtitan's chunked loss does so chunk by chunk).
    _skip_lm_head: bool = False

    def __init__(self, cfg, ffn_hidden: int, hf_norm: bool = False, **block):
        """ffn_hidden: the FFN width; hf_norm: every norm rounds as transformers' (RMSNorm);
        block: DecoderBlock's other options."""
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({
            str(i): DecoderBlock(cfg.dim, cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, ffn_hidden, cfg.rope_theta,
                                 cfg.norm_eps, hf_norm=hf_norm, **block)
            for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, hf_norm)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.enable_weight_tying = cfg.tie_embeddings

    def _tie_embeddings(self) -> None:
        """The head shares the embedding matrix when tied (again after `to_empty`, which unties it)."""
        if self.enable_weight_tying:
            self.lm_head.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, attention_masks: None = None):
        """tokens (B, L); positions (B, L) restarting at 0 per packed document, or None (one
        document per row); `attention_masks` exists for torchtitan's call signature and must be
        None (the mask comes from positions) -> logits (B, L, vocab_size), or the final hidden
        states (B, L, dim) under `_skip_lm_head`."""
        if attention_masks is not None:
            raise ValueError(f"{type(self).__name__} builds its own document mask from positions; "
                             "pass attention_masks=None")
        length = tokens.shape[1]
        if length > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {length} exceeds max_seq_len {self.cfg.max_seq_len}")
        rope_positions = positions if positions is not None else torch.arange(
            length, device=tokens.device).expand_as(tokens)
        h = self.decode(self.tok_embeddings(tokens), rope_positions, positions)
        return h if self._skip_lm_head else self.lm_head(h)

    def decode(self, h: torch.Tensor, rope_positions: torch.Tensor, positions: torch.Tensor | None = None):
        """Input embeddings h (B, L, dim) -> final-normed hidden states (B, L, dim): the
        blocks and the last norm; rope_positions (B, L), positions (B, L) for the document
        mask or None (one sequence per row). Prefix memories (GradMem) call it on
        embeddings that are not token embeddings."""
        for block in self.layers.values():
            h = block(h, rope_positions, positions)
        return self.norm(h)
