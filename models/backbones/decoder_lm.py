"""A plain-torch Llama / Qwen2 / Qwen3 decoder LM that loads Hugging Face checkpoints: the
backbone memories are grafted onto.

Architecture (transformers' LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM, which it
equals; tests in tests/test_backbone.py): token embeddings, `n_layers` pre-norm blocks
    x += W_o Attn(RoPE(q), RoPE(k), v);  q, k, v = W_{q,k,v} RMSNorm(x)   (GQA, explicit head_dim)
    x += W_2 (SiLU(W_1 h) * W_3 h);       h = RMSNorm(x)                   (SwiGLU)
then RMSNorm and the output head (tied to the embeddings or not). Qwen2 (and Qwen2.5, the
same architecture) adds biases to W_q, W_k, W_v, not to W_o (`qkv_bias`; Qwen2Attention);
Qwen3 instead adds an RMSNorm over each head of q and k before RoPE (`qk_norm`). RoPE uses
Hugging Face's layout (halves rotate together) and Llama 3's frequency scaling when
`rope_scaling` says so. RMSNorm and RoPE
angles are computed in float32 (float64 for float64 inputs in the norm) as transformers does.

Attribute names (tok_embeddings, layers, norm, lm_head, and attention / feed_forward /
attention_norm / ffn_norm inside blocks) follow torchtitan's decoders, so its AC / compile /
FSDP2 helpers apply; `torchtitan_ext/families/backbone.py` maps them to and from Hugging Face keys.
Documents packed in a row are kept apart through `positions` (restarting at 0 per document).

Shapes: tokens (B, L) int64 -> logits (B, L, vocab_size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from models.grafts.graft import apply_graft, GraftConfig, reset_grafts
from models.layers.attention import document_causal_attention
from models.layers.ffn import SwiGLU
from models.layers.rope import apply_half_rope, rope_inv_freq

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_SCALING_FIELDS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class DecoderLMConfig:
    architecture: str = "llama"  # "llama" | "qwen2" | "qwen3": which transformers class it exports as
    vocab_size: int = 4096
    dim: int = 64  # hidden_size
    n_layers: int = 2  # num_hidden_layers
    n_heads: int = 4  # num_attention_heads
    n_kv_heads: int = 2  # num_key_value_heads
    head_dim: int | None = None  # explicit (Qwen3); default dim // n_heads
    ffn_hidden: int = 128  # intermediate_size
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    qkv_bias: bool = False  # Qwen2: biases on W_q, W_k, W_v (W_o has none)
    rope_theta: float = 500000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 131072  # max_position_embeddings
    init_std: float = 0.02
    graft: GraftConfig = field(default_factory=GraftConfig)  # what is grafted onto the blocks (models/grafts/graft.py)

    @property
    def stream_segment(self) -> int:
        """`DecoderLM.stream` continues from any token (the caches hold everything)."""
        return 1

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"backbone architecture '{self.architecture}' unknown: choose one of {ARCHITECTURES}")
        self.head_dim = self.head_dim or self.dim // self.n_heads
        if self.rope_scaling:  # a copy holding the scaling's own fields (transformers 5 adds rope_theta to its dict)
            self.rope_scaling = {k: self.rope_scaling[k] for k in ROPE_SCALING_FIELDS if k in self.rope_scaling}
        if isinstance(self.graft, dict):
            self.graft = GraftConfig(**self.graft)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}")


class DecoderState(NamedTuple):
    """A stream's state: per block its cache (keys, values), a MemoryLlama block's (keys,
    values, MemoryState), a MoNe block's `MoNeCache`, None before the first call; and the
    number of tokens read so far."""

    caches: tuple
    seen: int = 0


class RMSNorm(nn.Module):
    """weight * x / rms(x), the statistics in float32 (float64 stays float64), cast back
    before the weight, as transformers' LlamaRMSNorm. x (..., dim) -> (..., dim)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = x if x.dtype == torch.float64 else x.float()
        work = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * work.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderLMConfig):
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x (B, L, dim), positions (B, L) -> q (B, n_heads, L, head_dim), k and v
        (B, n_kv_heads, L, head_dim): projected, q/k-normed (Qwen3) and rotated."""
        q = self.wq(x).unflatten(-1, (-1, self.cfg.head_dim))
        if self.cfg.qk_norm:
            q = self.q_norm(q)
        return (apply_half_rope(q.transpose(1, 2), positions, self.inv_freq), *self.project_kv(x, positions))

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor):
        """x (B, L, dim), positions (B, L) -> k, v (B, n_kv_heads, L, head_dim) as `project`'s."""
        k, v = (w(x).unflatten(-1, (-1, self.cfg.head_dim)) for w in (self.wk, self.wv))
        if self.cfg.qk_norm:
            k = self.k_norm(k)
        return apply_half_rope(k.transpose(1, 2), positions, self.inv_freq), v.transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_positions: torch.Tensor | None):
        """Projected q (B, n_heads, Lq, head_dim) over k, v (B, n_kv_heads, Lk, head_dim), the
        queries being the last Lq of the Lk tokens; doc_positions (B, Lk) or None -> (B, Lq, dim)."""
        out = document_causal_attention(q, k, v, doc_positions, scale=1 / math.sqrt(self.cfg.head_dim))
        return self.wo(out.transpose(1, 2).flatten(-2))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, doc_positions: torch.Tensor | None) -> torch.Tensor:
        """x (B, L, dim); positions (B, L) for RoPE; doc_positions (B, L) or None for masking."""
        return self.attend(*self.project(x, positions), doc_positions)


class Block(nn.Module):
    def __init__(self, cfg: DecoderLMConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg.dim, cfg.ffn_hidden)

    def forward(self, x, positions, doc_positions):
        x = x + self.attention(self.attention_norm(x), positions, doc_positions)
        return x + self.feed_forward(self.ffn_norm(x))

    def step(self, x: torch.Tensor, positions: torch.Tensor, cache: tuple | None):
        """The next tokens of a stream (one document per row): x (B, L, dim), positions (B, L)
        continuing the stream's; cache (keys, values) of the tokens before or None ->
        (output, cache with x's keys and values appended)."""
        q, k, v = self.attention.project(self.attention_norm(x), positions)
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        x = x + self.attention.attend(q, k, v, None)
        return x + self.feed_forward(self.ffn_norm(x)), (k, v)


class DecoderLM(nn.Module):
    """Llama / Qwen2 / Qwen3 decoder LM (module docstring)."""

    _skip_lm_head: bool = False  # torchtitan's chunked loss applies lm_head itself

    def __init__(self, cfg: DecoderLMConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.enable_weight_tying = cfg.tie_embeddings
        apply_graft(self, cfg.graft)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, init_std) for every matrix and zero biases (transformers' init; pretrained
        weights replace it), norms to one, head re-tied; then the grafts' own init
        (`reset_grafts`: LoRA B = 0, MemoryLlama's `init`); RoPE frequencies recomputed
        (`reset_buffers`)."""
        with torch.no_grad():
            if self.enable_weight_tying:
                self.lm_head.weight = self.tok_embeddings.weight
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=self.cfg.init_std)
                    if getattr(module, "bias", None) is not None:
                        nn.init.zeros_(module.bias)
                elif isinstance(module, RMSNorm):
                    module.reset_parameters()
            reset_grafts(self)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """The RoPE frequencies (not in checkpoints), on the model's device, in float32:
        after `to_empty`, or after a load that materialised them empty."""
        device = self.tok_embeddings.weight.device
        for module in self.modules():
            if isinstance(module, Attention):
                module.inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling).to(device)

    def stream(self, tokens: torch.Tensor, state: DecoderState | None = None):
        """Logits of tokens (B, T) continuing the stream `state` (None: a new one, one
        document per row), and the state after them: every block's key / value cache (and a
        MemoryLlama block's memory state). Any split of a sequence gives its one-pass logits
        (up to rounding): MemoryLlama's chunks stay aligned to the stream's positions."""
        state = state or DecoderState((None,) * len(self.layers))
        positions = torch.arange(state.seen, state.seen + tokens.shape[1], device=tokens.device).expand_as(tokens)
        h, caches = self.tok_embeddings(tokens), []
        for block, cache in zip(self.layers.values(), state.caches):
            h, cache = block.step(h, positions, cache)
            caches.append(cache)
        return self.lm_head(self.norm(h)), DecoderState(tuple(caches), state.seen + tokens.shape[1])

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, attention_masks: None = None):
        """tokens (B, L); positions (B, L) restarting at 0 per packed document, or None (one
        document per row); `attention_masks` must be None (the mask comes from positions)."""
        if attention_masks is not None:
            raise ValueError("DecoderLM builds its own document mask from positions; pass attention_masks=None")
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.cfg.max_seq_len}")
        rope_positions = positions if positions is not None else torch.arange(
            tokens.shape[1], device=tokens.device).expand_as(tokens)
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


def config_from_hf(hf: dict) -> DecoderLMConfig:
    """A Hugging Face `config.json` (dict) of a Llama, Qwen2 (Qwen2.5) or Qwen3 model ->
    DecoderLMConfig; ValueError naming what is not supported. Qwen2 has q/k/v biases whatever
    the file says (transformers' Qwen2Attention hard-codes them; transformers 5 writes no
    `attention_bias` for it)."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise ValueError(f"config.json has model_type '{kind}': this backbone loads {ARCHITECTURES}")
    if (hf.get("attention_bias") and kind != "qwen2") or hf.get("mlp_bias"):
        raise ValueError("attention biases (other than Qwen2's on q/k/v) or MLP biases are not supported by this "
                         "backbone")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act '{hf['hidden_act']}' is not supported: the backbone's FFN is SwiGLU")
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise ValueError("sliding-window attention is not supported by this backbone")
    params = dict(hf.get("rope_parameters") or {})  # transformers 5; older files: rope_theta / rope_scaling
    theta = hf.get("rope_theta") or params.get("rope_theta", 10000.0)
    rope = hf.get("rope_scaling") or params
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("llama3", "default"):  # e.g. Qwen2.5's optional YaRN
        raise ValueError(f"rope scaling '{rope_type}' is not supported: only 'llama3' (or none)")
    return DecoderLMConfig(
        architecture=kind, vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"), ffn_hidden=hf["intermediate_size"], qk_norm=kind == "qwen3",
        qkv_bias=kind == "qwen2", rope_theta=float(theta), rope_scaling=rope if rope_type == "llama3" else None,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=hf.get("max_position_embeddings", 131072))
