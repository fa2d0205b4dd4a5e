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
`rope_scaling` says so. RMSNorm statistics and RoPE angles are computed in float32 (float64
for float64 inputs in the norm) and rounded as transformers does. The blocks and the LM
skeleton are `models/layers/decoder.py`'s (options `rope="halves"`, `hf_norm`, `qkv_bias`,
`qk_norm`, `head_dim`); this module adds the config, streaming and grafts.

Attribute names (tok_embeddings, layers, norm, lm_head, and attention / feed_forward /
attention_norm / ffn_norm inside blocks) follow torchtitan's decoders, so its AC / compile /
FSDP2 helpers apply; `torchtitan_ext/families/backbone.py` maps them to and from Hugging Face keys.
Documents packed in a row are kept apart through `positions` (restarting at 0 per document).

Shapes: tokens (B, L) int64 -> logits (B, L, vocab_size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from models.grafts.graft import apply_graft, GraftConfig, reset_grafts
from models.layers.decoder import Attention, DecoderLMBase, RMSNorm

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
    stream_window: int = 0  # `DecoderLM.stream` only: each token attends to at most this many tokens (0: all)

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
    values, MemoryState, tokens seen), a MoNe block's `MoNeCache`, None before the first call;
    and the number of tokens read so far."""

    caches: tuple
    seen: int = 0


class DecoderLM(DecoderLMBase):
    """Llama / Qwen2 / Qwen3 decoder LM (module docstring): `models/layers/decoder.py`'s blocks
    with Hugging Face's RoPE layout ("halves") and transformers' RMSNorm rounding."""

    def __init__(self, cfg: DecoderLMConfig):
        super().__init__(cfg, cfg.ffn_hidden, hf_norm=True, head_dim=cfg.head_dim, rope="halves",
                         rope_scaling=cfg.rope_scaling, qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm)
        apply_graft(self, cfg.graft)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, init_std) for every matrix and zero biases (transformers' init; pretrained
        weights replace it), norms to one, head re-tied; then the grafts' own init
        (`reset_grafts`: LoRA B = 0, MemoryLlama's `init`); RoPE frequencies recomputed
        (`reset_buffers`)."""
        with torch.no_grad():
            self._tie_embeddings()
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
                module.reset_buffers(device)

    def stream(self, tokens: torch.Tensor, state: DecoderState | None = None):
        """Logits of tokens (B, T) continuing the stream `state` (None: a new one, one
        document per row), and the state after them: every block's key / value cache (and a
        MemoryLlama block's memory state). Any split of a sequence gives its one-pass logits
        (up to rounding): MemoryLlama's chunks stay aligned to the stream's positions.

        With `cfg.stream_window` W > 0 the attention is bounded instead (sliding-window
        attention, token by token exactly): before a call of T tokens every block keeps the
        keys and values of only the last W - T tokens before them (`keep_last`), so in each
        block a token attends to at most W tokens, itself included (between W - T + 1 and W),
        at distances a backbone of native context W was trained on, and the caches stay
        bounded. As in any sliding-window model, a cached key was computed from its own window,
        so n_layers blocks reach up to n_layers (W - 1) tokens back; beyond that only a memory
        reaches (a MemoryLlama block's memory state is kept whole; a MoNe block attends inside
        its segment anyway). ValueError for a call of more than W tokens."""
        window = self.cfg.stream_window
        if window and tokens.shape[1] > window:
            raise ValueError(f"a stream call of {tokens.shape[1]} tokens exceeds stream_window {window}: "
                             f"stream in pieces of at most {window} tokens")
        state = state or DecoderState((None,) * len(self.layers))
        positions = torch.arange(state.seen, state.seen + tokens.shape[1], device=tokens.device).expand_as(tokens)
        h, caches = self.tok_embeddings(tokens), []
        for block, cache in zip(self.layers.values(), state.caches):
            if window and cache is not None:
                cache = block.keep_last(cache, window - tokens.shape[1])
            h, cache = block.step(h, positions, cache)
            caches.append(cache)
        return self.lm_head(self.norm(h)), DecoderState(tuple(caches), state.seen + tokens.shape[1])


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
