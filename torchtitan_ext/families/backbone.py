"""The pretrained backbone family (`models/backbones/decoder_lm.py`): Hugging Face Llama /
Qwen2 / Qwen3 key names, reading a Hugging Face folder, and the registry entry.

Flavors: the public configs of Llama-3.2-1B, Qwen2.5-0.5B (MoNe's backbone; its Instruct
model has the same config), Qwen3-0.6B and Qwen3-1.7B (their parameter counts are checked in
tests/test_backbone.py), and `llama_debug` / `qwen2_debug` / `qwen3_debug` for CPU (the
4096-piece offline tokenizer; Qwen3's explicit head_dim differs from dim / heads there as in
the real ones; Qwen2's q/k/v biases, tied head, rope theta 1e6 and norm eps 1e-6 as in
Qwen2.5-0.5B).

Its torchtitan StateDictAdapter is `backbone_adapter.HFBackboneAdapter` (so
`--checkpoint.initial_load_in_hf` and the exporter work): keys are renamed by `to_hf_keys` /
`from_hf_keys`, nothing is permuted (the backbone uses Hugging Face's RoPE layout). Nothing
here imports torchtitan. `load_hf_backbone(folder)` and the preflight of an initial load
(`check_hf_folder`) check `config.json` against the flavor's config and every weight's shape
in the safetensors headers before anything is materialised.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from models.backbones.decoder_lm import config_from_hf, DecoderLM, DecoderLMConfig
from models.grafts.graft import graft_diagnostics, GRAFT_KINDS
from torchtitan_ext import flops
from torchtitan_ext.errors import UserError
from torchtitan_ext.families import Family

# (our key pattern, Hugging Face key pattern); {} is the layer index.
KEY_MAP = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    *((f"layers.{{}}.attention.w{p}.weight", f"model.layers.{{}}.self_attn.{p}_proj.weight") for p in "qkvo"),
    *((f"layers.{{}}.attention.w{p}.bias", f"model.layers.{{}}.self_attn.{p}_proj.bias") for p in "qkv"),  # Qwen2
    *((f"layers.{{}}.attention.{p}_norm.weight", f"model.layers.{{}}.self_attn.{p}_norm.weight") for p in "qk"),
    ("layers.{}.attention_norm.weight", "model.layers.{}.input_layernorm.weight"),
    ("layers.{}.ffn_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
    ("layers.{}.feed_forward.w1.weight", "model.layers.{}.mlp.gate_proj.weight"),
    ("layers.{}.feed_forward.w3.weight", "model.layers.{}.mlp.up_proj.weight"),
    ("layers.{}.feed_forward.w2.weight", "model.layers.{}.mlp.down_proj.weight"),
)


def _rename(key: str, source: int) -> str:
    """`key` from one naming (0: ours, 1: Hugging Face) to the other; UserError if unknown."""
    for pair in KEY_MAP:
        pattern = re.escape(pair[source]).replace(r"\{\}", r"(\d+)")
        match = re.fullmatch(pattern, key)
        if match:
            return pair[1 - source].format(*match.groups())
    raise UserError(f"weight '{key}' has no counterpart in a Llama / Qwen2 / Qwen3 checkpoint: is this a backbone model?")


GRAFT_KEY = re.compile(r"\.(lora_A|lora_B|memory[a-z_]*)(\.|$)")


def is_graft_key(key: str) -> bool:
    """Weights a graft adds (no Hugging Face counterpart): LoRA factors, a memory's `memory*`."""
    return GRAFT_KEY.search(key) is not None


def to_hf_keys(state: dict, tied: bool) -> dict:
    """Our backbone keys -> Hugging Face keys; graft weights are left out (an initial load
    from a Hugging Face folder leaves them at their init; the exporter merges or refuses)."""
    return {_rename(k, 0): v for k, v in state.items() if not (tied and k == "lm_head.weight") and not is_graft_key(k)}


def from_hf_keys(state: dict, tied: bool) -> dict:
    ours = {_rename(k, 1): v for k, v in state.items()}
    if tied:
        ours["lm_head.weight"] = ours["tok_embeddings.weight"]
    return ours


def read_hf_config(folder: Path) -> DecoderLMConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"no config.json in '{folder}': pass a Hugging Face Llama, Qwen2 or Qwen3 model folder")
    try:
        return config_from_hf(json.loads(path.read_text()))
    except ValueError as e:
        raise UserError(f"'{path}': {e}") from None


def check_matches(expected: DecoderLMConfig, found: DecoderLMConfig, folder: Path) -> None:
    """UserError naming the first field where a checkpoint's config differs from the flavor's."""
    for field in ("architecture", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden",
                  "qk_norm", "qkv_bias", "rope_theta", "rope_scaling", "tie_embeddings"):
        if getattr(expected, field) != getattr(found, field):
            raise UserError(f"'{folder}' holds a model with {field}={getattr(found, field)!r}, the flavor has "
                            f"{getattr(expected, field)!r}: pass the flavor this checkpoint was made for")


def check_weight_shapes(config: DecoderLMConfig, folder: Path) -> None:
    """UserError naming the first backbone weight of `config` that the safetensors of `folder`
    lack or hold at another shape (read from the file headers, Hugging Face names; graft
    weights are not in such a folder)."""
    from torchtitan_ext.hf_export import safetensors_shapes

    with torch.device("meta"):
        state = DecoderLM(config).state_dict()
    expected = {k: tuple(v.shape) for k, v in to_hf_keys(state, config.tie_embeddings).items()}
    stored = safetensors_shapes(Path(folder))
    missing = [k for k in expected if k not in stored]
    if missing:
        raise UserError(f"'{folder}' lacks {len(missing)} of {len(expected)} weights (e.g. '{missing[0]}'): an "
                        "incomplete checkpoint")
    for key, shape in expected.items():
        if stored[key] != shape:
            raise UserError(f"'{folder}': weight '{key}' has shape {stored[key]}, its config.json's model needs "
                            f"{shape}: the weights and config.json disagree (a broken or edited checkpoint)")


def check_hf_folder(config: DecoderLMConfig, folder: Path) -> None:
    """UserError unless `folder` holds a model of `config`'s shape: config.json's fields,
    then every weight's shape (preflight of `--checkpoint.initial_load_in_hf`)."""
    check_matches(config, read_hf_config(folder), folder)
    check_weight_shapes(config, folder)


def load_hf_backbone(folder: Path, expected: DecoderLMConfig | None = None) -> DecoderLM:
    """The DecoderLM of a Hugging Face folder (config.json + safetensors), fp32; with
    `expected`, its config is checked first; the weights' shapes always (one-line UserError,
    nothing built)."""
    from torchtitan_ext.hf_export import load_safetensors

    config = read_hf_config(folder)
    if expected is not None:
        check_matches(expected, config, folder)
    check_weight_shapes(config, folder)
    with torch.device("meta"):
        model = DecoderLM(config)
    model.load_state_dict(from_hf_keys(load_safetensors(Path(folder)), config.tie_embeddings), assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.tok_embeddings.weight
    model.reset_buffers()  # RoPE frequencies are not in checkpoints
    return model.float()


LLAMA3_2_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
QWEN3 = dict(architecture="qwen3", vocab_size=151936, n_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=1000000.0,
             norm_eps=1e-6, tie_embeddings=True, max_seq_len=40960)
# Qwen2.5-0.5B(-Instruct)'s config.json: q/k/v biases, theta 1e6, eps 1e-6, tied head, 32K window.
QWEN2 = dict(architecture="qwen2", vocab_size=151936, qkv_bias=True, rope_theta=1000000.0, norm_eps=1e-6,
             tie_embeddings=True, max_seq_len=32768)
FLAVORS = {
    "llama_debug": dict(vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384,
                        rope_scaling=dict(LLAMA3_2_ROPE, original_max_position_embeddings=64)),
    "qwen2_debug": dict(QWEN2, vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384),
    "qwen3_debug": dict(QWEN3, vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64,
                        ffn_hidden=384),
    "llama3_2_1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
                        rope_scaling=LLAMA3_2_ROPE, tie_embeddings=True),
    "qwen2_5_0_5b": dict(QWEN2, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_hidden=4864),
    "qwen3_0_6b": dict(QWEN3, dim=1024, n_layers=28, n_heads=16, ffn_hidden=3072),
    "qwen3_1_7b": dict(QWEN3, dim=2048, n_layers=28, n_heads=16, ffn_hidden=6144),
}


def hf_config(cfg: DecoderLMConfig):
    """The transformers LlamaConfig / Qwen2Config / Qwen3Config of a plain backbone config (its
    export is a plain LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM); None for a
    grafted one, which exports as remote code (backbone + graft; `--merge-lora` first turns a
    LoRA-only graft plain)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if cfg.graft.kind != "none":
        return None
    fields = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_hidden,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                  head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                  max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings)
    if cfg.architecture == "qwen3":
        return Qwen3Config(**fields, architectures=["Qwen3ForCausalLM"])
    if cfg.architecture == "qwen2":  # q/k/v biases are Qwen2Attention's own; no sliding window
        return Qwen2Config(**fields, use_sliding_window=False, architectures=["Qwen2ForCausalLM"])
    return LlamaConfig(**fields, rope_scaling=dict(cfg.rope_scaling) if cfg.rope_scaling else None,
                       architectures=["LlamaForCausalLM"])


def flops_per_token(cfg: DecoderLMConfig, seq_len: int) -> float:
    """Per token: the backbone's GQA projections (explicit head_dim) and span, SwiGLU FFN,
    output head, and what a graft adds: LoRA factors (`flops.lora`) and its kind's row of
    `GRAFT_KINDS` (the FLOP column: what its blocks change in the backbone and add, forward).
    A frozen backbone's matmuls count 2x their forward (the activations' gradient is still
    taken, the weights' is not), trained ones and the graft's 3x."""
    d, q = cfg.dim, cfg.n_heads * cfg.head_dim
    backbone = cfg.n_layers * (flops.decoder_block_linears(cfg) + flops.attention_span(q, seq_len)) + flops.linear(d, cfg.vocab_size)
    kind = GRAFT_KINDS[cfg.graft.kind]
    changed, added = kind.flops(cfg, seq_len) if kind.flops else (0.0, 0.0)
    frozen = cfg.graft.kind != "none" and cfg.graft.train == "graft"
    return ((flops.FORWARD_AND_INPUT_GRAD if frozen else flops.TRAIN) * (backbone + changed)
            + flops.TRAIN * (flops.lora(cfg) + added))


ADAPTER = "torchtitan_ext.families.backbone_adapter:HFBackboneAdapter"
FAMILY = Family(name="backbone", summary="Pretrained Llama / Qwen2 / Qwen3 decoder (loads Hugging Face checkpoints; grafts "
                "build on it)", flavors=FLAVORS, config_class=DecoderLMConfig, plain_class=DecoderLM,
                hf_config=hf_config, state_dict_adapter=ADAPTER, flops_per_token=flops_per_token,
                diagnostics=graft_diagnostics,
                check_hf_folder=check_hf_folder)
model_config, model_spec = FAMILY.config, FAMILY.model_spec
