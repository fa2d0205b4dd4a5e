"""Transformer++ (Llama: RMSNorm, SwiGLU, RoPE, GQA) = torchtitan's own llama3 model.

Only the flavors are ours: `debug` for CPU, and `400m` / `800m` / `1b2` sized to the
Mela paper's baselines (Table 1 totals, Llama-2 32K vocabulary, untied embeddings).
Shapes chosen (parameter counts from `scripts/param_counts.py`, checked by tests):

| flavor | dim | layers | heads / kv heads | ffn hidden | params |
| --- | --- | --- | --- | --- | --- |
| debug | 256 | 4 | 4 / 2 | 768 | 5.2M (4096 vocab) |
| small | 128 | 7 | 4 / 2 | 384 | 2.4M (4096 vocab; the size of mela_debug, its peer) |
| 400m | 1024 | 24 | 16 / 8 | 3520 | 400.6M |
| 800m | 1536 | 27 | 16 / 8 | 4096 | 799.0M |
| 1b2 | 2048 | 22 | 16 / 8 | 5888 | 1203.8M |
| mela_400m_peer | 1024 | 21 | 16 / 8 | 3520 | 358.7M (Mela 400m: 356.5M) |
| mela_800m_peer | 1536 | 22 | 16 / 8 | 4224 | 682.3M (Mela 800m: 681.8M) |
| mela_1b2_peer | 2048 | 18 | 16 / 8 | 6144 | 1037.1M (Mela 1b2: 1029.0M) |
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_ext.families import Family

# torchtitan is imported inside the functions that build its model, so the flavors (`Shape`,
# `FLAVORS`, `FAMILY`) load without it: scripts/bench_models.py builds the same shapes as a
# plain decoder on torch versions torchtitan 0.3.0 does not run on.


@dataclass(frozen=True)
class Shape:
    """A flavor's sizes (the fields its torchtitan Llama3Model.Config is built from)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int = 32000
    max_seq_len: int = 131072


FLAVORS = {
    "debug": dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=768, vocab_size=4096),
    "small": dict(dim=128, n_layers=7, n_heads=4, n_kv_heads=2, ffn_hidden=384, vocab_size=4096),
    # the leaderboard cpu suite's row, at the memory rows' non-embedding parameters (train_configs/leaderboard.py)
    "leaderboard_cpu": dict(dim=128, n_layers=10, n_heads=4, n_kv_heads=2, ffn_hidden=384, vocab_size=4096),
    "400m": dict(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_hidden=3520),
    "800m": dict(dim=1536, n_layers=27, n_heads=16, n_kv_heads=8, ffn_hidden=4096),
    "1b2": dict(dim=2048, n_layers=22, n_heads=16, n_kv_heads=8, ffn_hidden=5888),
    # Parameter-matched peers of the Mela flavors (their totals within 2%).
    "mela_400m_peer": dict(dim=1024, n_layers=21, n_heads=16, n_kv_heads=8, ffn_hidden=3520),
    "mela_800m_peer": dict(dim=1536, n_layers=22, n_heads=16, n_kv_heads=8, ffn_hidden=4224),
    "mela_1b2_peer": dict(dim=2048, n_layers=18, n_heads=16, n_kv_heads=8, ffn_hidden=6144),
}


def model_config(flavor: str, attn_backend: str = "auto") -> Llama3Model.Config:
    """torchtitan Llama3Model config for a flavor. attn_backend: "auto"
    (`auto_attention_backend`), "cpu", or any torchtitan backend name (flex, flex_flash, varlen)."""
    return llama3_config(FAMILY.config(flavor), attn_backend)


def llama3_config(s: Shape, attn_backend: str = "auto") -> Llama3Model.Config:
    """torchtitan Llama3Model config of any Shape (RoPE theta 500000, no scaling)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import _build_llama3_layers, _EMBEDDING_INIT, _NORM_INIT, _output_linear_init, Llama3Model

    from torchtitan_ext.training.cpu import has_accelerator
    from torchtitan_ext.training.llama3_cpu_attention import auto_attention_backend, use_cpu_attention

    if attn_backend == "auto":
        attn_backend = auto_attention_backend(has_accelerator())
    config = Llama3Model.Config(
        dim=s.dim,
        vocab_size=s.vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=s.vocab_size, embedding_dim=s.dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=s.dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=s.dim, out_features=s.vocab_size, param_init=_output_linear_init(s.dim)),
        layers=_build_llama3_layers(
            n_layers=s.n_layers,
            dim=s.dim,
            n_heads=s.n_heads,
            n_kv_heads=s.n_kv_heads,
            hidden_dim=s.ffn_hidden,
            rope=ComplexRoPE.Config(dim=s.dim // s.n_heads, max_seq_len=s.max_seq_len, theta=500000, scaling="none"),
            attn_backend="flex" if attn_backend == "cpu" else attn_backend,
        ),
    )
    if attn_backend == "cpu":
        use_cpu_attention(config)
    return config


def model_spec(flavor: str, attn_backend: str = "auto") -> ModelSpec:
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from torchtitan.protocols.model_spec import ModelSpec

    return ModelSpec(
        name="transformer",
        flavor=flavor,
        model=model_config(flavor, attn_backend),
        parallelize_fn=parallelize_llama,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=Llama3StateDictAdapter,
    )


def hf_config(s: Shape):
    """The transformers LlamaConfig of a flavor (its export is a plain LlamaForCausalLM)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.dim, intermediate_size=s.ffn_hidden,
                       num_hidden_layers=s.n_layers, num_attention_heads=s.n_heads, num_key_value_heads=s.n_kv_heads,
                       rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=s.max_seq_len,
                       tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


FAMILY = Family(name="transformer", summary="Transformer++ baseline: torchtitan's llama3 (RMSNorm, SwiGLU, RoPE, GQA)",
                flavors=FLAVORS, config_class=Shape, build_spec=model_spec, hf_config=hf_config)
