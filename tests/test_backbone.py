"""The pretrained backbone (models/backbones/decoder_lm.py) against transformers' Llama, Qwen2
and Qwen3 and torchtitan's llama3 and qwen3, loaded from the same tiny random Hugging Face checkpoints."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from models.backbones.decoder_lm import DecoderLM, DecoderLMConfig
from torchtitan_ext.families.backbone import from_hf_keys, load_hf_backbone, to_hf_keys
from torchtitan_ext.errors import UserError

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}
CASES = {
    "llama_gqa_untied": ("llama", dict(num_key_value_heads=2, rope_theta=500000.0, tie_word_embeddings=False,
                                       rms_norm_eps=1e-5)),  # torchtitan's llama3 norm eps
    "llama_tied_rope_scaling": ("llama", dict(num_key_value_heads=4, rope_theta=500000.0, tie_word_embeddings=True,
                                              rope_scaling=LLAMA3_SCALING)),
    "qwen3_head_dim_32_tied": ("qwen3", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
    # Qwen2.5-0.5B's settings: q/k/v biases, theta 1e6, eps 1e-6, tied; and an untied one
    "qwen2_gqa_tied": ("qwen2", dict(num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                     tie_word_embeddings=True)),
    "qwen2_untied": ("qwen2", dict(num_key_value_heads=4, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                   tie_word_embeddings=False)),
}
ARCHITECTURE_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def hf_checkpoint(case: str, folder):
    """A tiny random transformers model of `case`, saved to `folder`; returns it (fp32, eval)."""
    import transformers

    kind, fields = CASES[case]
    config_cls, model_cls = (getattr(transformers, name) for name in ARCHITECTURE_CLASSES[kind])
    torch.manual_seed(0)
    model = model_cls(config_cls(**SHAPE, **fields)).eval()
    perturb_norms_and_biases(model)
    model.save_pretrained(folder)
    return model


def perturb_norms_and_biases(model) -> None:
    """Norms away from one and biases (Qwen2's q/k/v, zero at init) away from zero, so that a
    missed norm or bias shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_backbone_equals_transformers(case, tmp_path):
    reference = hf_checkpoint(case, tmp_path)
    ours = load_hf_backbone(tmp_path).eval()
    tokens = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(1))  # past 32: scaled RoPE matters
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), reference(tokens).logits, rtol=0, atol=1e-4)
        # float64: both compute RoPE angles (and transformers its norms) in float32, so the
        # difference is float32-sized there; it must still be far below the float32 one's scale.
        gap64 = (ours.double()(tokens) - reference.double()(tokens).logits).abs().max().item()
    assert gap64 < 1e-5


def test_keys_round_trip_and_the_tied_head_is_dropped():
    model = DecoderLM(DecoderLMConfig(qk_norm=True, tie_embeddings=True))
    hf = to_hf_keys(model.state_dict(), tied=True)
    assert "lm_head.weight" not in hf and "model.layers.1.self_attn.q_norm.weight" in hf
    back = from_hf_keys(hf, tied=True)
    assert back.keys() == model.state_dict().keys()


def test_the_pretrained_flavors_read_their_public_config_files():
    """config.json as the Hub has them (Llama 3.2: rope_scaling beside rope_theta; Qwen3) and as
    transformers 5 writes them (rope_parameters) give the flavors' configs."""
    from models.backbones.decoder_lm import config_from_hf
    from torchtitan_ext.families.backbone import check_matches, FAMILY, hf_config

    llama = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
             "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
             "max_position_embeddings": 131072, "hidden_act": "silu",
             "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                              "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    qwen3 = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
             "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
             "max_position_embeddings": 40960, "hidden_act": "silu", "use_sliding_window": False}
    qwen2_5 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
               "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
               "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
               "max_position_embeddings": 32768, "sliding_window": 32768, "max_window_layers": 21,
               "use_sliding_window": False, "attention_dropout": 0.0}  # Qwen2.5-0.5B-Instruct
    for flavor, hub in (("llama3_2_1b", llama), ("qwen3_0_6b", qwen3), ("qwen2_5_0_5b", qwen2_5)):
        expected = FAMILY.config(flavor)
        check_matches(expected, config_from_hf(hub), "hub")
        assert config_from_hf(hub).norm_eps == expected.norm_eps and config_from_hf(hub).max_seq_len == expected.max_seq_len
        check_matches(expected, config_from_hf(hf_config(expected).to_dict() | {"model_type": hub["model_type"]}),
                      "transformers 5")
    yarn = {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}  # Qwen2.5's long mode
    for refused, message in ((yarn, "rope scaling 'yarn' is not supported"),
                             ({"use_sliding_window": True}, "sliding-window attention is not supported")):
        with pytest.raises(ValueError, match=message):
            config_from_hf(qwen2_5 | refused)


def test_a_checkpoint_of_another_shape_is_one_clear_error(tmp_path):
    hf_checkpoint("llama_gqa_untied", tmp_path)
    expected = DecoderLMConfig(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=96)
    with pytest.raises(UserError, match="n_layers=2, the flavor has 3"):
        load_hf_backbone(tmp_path, expected)
    with pytest.raises(UserError, match="no config.json"):
        load_hf_backbone(tmp_path / "nowhere")


def test_packed_documents_do_not_see_each_other_and_the_model_is_causal(float64):
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig(qk_norm=True)).eval()
    tokens = torch.randint(0, 4096, (1, 24))
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None]
    with torch.no_grad():
        packed = model(tokens, positions)
        first, second = model(tokens[:, :10]), model(tokens[:, 10:])
        torch.testing.assert_close(packed, torch.cat([first, second], 1), rtol=0, atol=1e-12)
        changed = tokens.clone()
        changed[0, 15] = (changed[0, 15] + 1) % 4096
        assert torch.equal(model(changed)[:, :15], model(tokens)[:, :15])  # causality: t=15 changes nothing before it
        assert not torch.equal(model(changed)[:, 15:], model(tokens)[:, 15:])


def banded_logits(model: DecoderLM, tokens: torch.Tensor, window: int) -> torch.Tensor:
    """One pass of `model` with sliding-window attention written out: in every block, token t
    attends to tokens t - window + 1 .. t (softmax over the band, GQA heads repeated), from
    the block's own projections, norms and FFN."""
    h, positions = model.tok_embeddings(tokens), torch.arange(tokens.shape[1])
    rows, cols = positions[:, None], positions[None, :]
    band = (cols <= rows) & (cols > rows - window)
    for block in model.layers.values():
        attention = block.attention
        q, k, v = attention.project(block.attention_norm(h), positions)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~band, float("-inf"))
        h = h + attention.wo((scores.softmax(-1) @ v).transpose(1, 2).flatten(-2))
        h = h + block.feed_forward(block.ffn_norm(h))
    return model.lm_head(model.norm(h))


def test_a_bounded_stream_is_sliding_window_attention_in_every_block(float64):
    """stream_window W, token by token: every block attends to the last W tokens only (the
    band of `banded_logits`); a call longer than W is refused."""
    torch.manual_seed(0)
    window = 5
    model = DecoderLM(DecoderLMConfig(qk_norm=True, stream_window=window)).eval()
    tokens = torch.randint(0, 4096, (2, 13))
    with torch.no_grad():
        state, streamed = None, []
        for t in range(tokens.shape[1]):
            logits, state = model.stream(tokens[:, t:t + 1], state)
            streamed.append(logits)
        # RoPE's frequencies are float32 (transformers'), so the stream's absolute positions
        # and the band's agree to rounding, not exactly
        torch.testing.assert_close(torch.cat(streamed, 1), banded_logits(model, tokens, window), rtol=0, atol=1e-6)
        assert (torch.cat(streamed, 1) - model(tokens)).abs().max() > 1e-3  # the band cuts something
        assert all(cache[0].shape[2] == window for cache in state.caches)
        with pytest.raises(ValueError, match="exceeds stream_window 5"):
            model.stream(tokens[:, :6])


def assert_same_logits(ours, titan) -> None:
    """Our backbone and a torchtitan model give the same logits on 2 x 80 random tokens."""
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    titan.eval()
    tokens = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(80).expand_as(tokens)
    with torch.no_grad():
        theirs = titan(tokens, positions=positions, attention_masks=create_varlen_metadata_for_document(positions))
        torch.testing.assert_close(ours(tokens), theirs, rtol=0, atol=1e-4)


def test_backbone_equals_torchtitans_llama3_on_the_same_hf_weights(tmp_path):
    """torchtitan's llama3 (its own RoPE layout: its adapter permutes q and k) and ours read
    one Hugging Face checkpoint and give the same logits."""
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    from torchtitan_ext.hf_export import load_safetensors
    from torchtitan_ext.families.transformer import llama3_config, Shape

    hf_checkpoint("llama_gqa_untied", tmp_path)
    ours = load_hf_backbone(tmp_path).eval()
    shape = Shape(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, vocab_size=256, max_seq_len=512)
    config = llama3_config(shape, attn_backend="cpu")
    titan = config.build()
    titan.init_weights(buffer_device=None)
    adapter = Llama3StateDictAdapter(config, None)
    loaded = titan.load_state_dict(adapter.from_hf(load_safetensors(tmp_path)), strict=False)
    parameters = {name for name, _ in titan.named_parameters()}
    assert not loaded.unexpected_keys and not parameters & set(loaded.missing_keys)  # every weight came from the file
    assert_same_logits(ours, titan)



# The model cards' figures: Llama 3.2 1B "1.23B"; Qwen2.5-0.5B "0.49B, non-embedding 0.36B";
# Qwen3-0.6B "0.6B, non-embedding 0.44B"; Qwen3-1.7B "1.7B, non-embedding 1.4B".
PUBLISHED = {"llama3_2_1b": (1.23e9, None), "qwen2_5_0_5b": (0.49e9, 0.36e9), "qwen3_0_6b": (0.6e9, 0.44e9),
             "qwen3_1_7b": (1.7e9, 1.4e9)}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_pretrained_flavors_have_the_published_sizes(flavor):
    from torchtitan_ext.families.backbone import FAMILY

    with torch.device("meta"):
        model = DecoderLM(FAMILY.config(flavor))
    total = sum(p.numel() for p in model.parameters())
    total_claimed, body_claimed = PUBLISHED[flavor]
    assert abs(total / total_claimed - 1) < 0.02
    if body_claimed:
        assert abs((total - model.tok_embeddings.weight.numel()) / body_claimed - 1) < 0.02


def debug_checkpoint(folder, flavor: str, perturb: bool = False, **changes):
    """A random transformers model of a debug flavor's architecture and shape (`changes`:
    config.json fields to set otherwise; `perturb`: norms and biases away from their init),
    saved to `folder`."""
    import transformers

    from torchtitan_ext.families.backbone import FAMILY

    c = FAMILY.config(flavor)
    config_cls, model_cls = (getattr(transformers, name) for name in ARCHITECTURE_CLASSES[c.architecture])
    fields = dict(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_hidden, num_hidden_layers=c.n_layers,
                  num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
                  rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_embeddings,
                  max_position_embeddings=c.max_seq_len)
    torch.manual_seed(0)
    model = model_cls(config_cls(**(fields | changes)))
    if perturb:
        perturb_norms_and_biases(model)
    model.save_pretrained(folder)


def qwen3_debug_checkpoint(folder, n_layers: int | None = None):
    """A random transformers Qwen3 of the `qwen3_debug` flavor's shape (or another depth)."""
    debug_checkpoint(folder, "qwen3_debug", **({"num_hidden_layers": n_layers} if n_layers else {}))


HF_START = ["--module", "train_configs.backbone", "--config", "backbone_qwen3_debug", "--checkpoint.initial_load_in_hf",
            "--validator.no-enable"]


@pytest.mark.slow
def test_training_starts_from_a_hugging_face_checkpoint(tokenizer_dir, tmp_path):
    """`--checkpoint.initial_load_in_hf` reads the weights through the backbone's adapter: at
    learning rate 0 the step-2 checkpoint holds the file's tensors bit for bit; at the debug
    learning rate 6 steps lower the loss (8.35 -> 7.50, measured 2026-11-30)."""
    from conftest import train
    from torchtitan_ext.training.checkpoints import build_model, load_dcp_model

    qwen3_debug_checkpoint(tmp_path / "hf")
    frozen = train(HF_START + ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--optimizer.param-groups.0.optimizer-kwargs.lr", "0",
                               "--training.steps", "2", "--checkpoint.interval", "2", "--dump_folder", str(tmp_path / "a")])
    assert frozen.returncode == 0, frozen
    model, _ = build_model("train_configs.backbone", "backbone_qwen3_debug")
    load_dcp_model(model, tmp_path / "a" / "checkpoint" / "step-2")
    source = load_hf_backbone(tmp_path / "hf").state_dict()
    assert all(torch.equal(value, source[key]) for key, value in model.state_dict().items())

    tuned = train(HF_START + ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--training.steps", "6",
                              "--dump_folder", str(tmp_path / "b")])
    assert tuned.returncode == 0, tuned
    assert tuned.losses[6] < tuned.losses[1] - 0.5


def test_an_hf_checkpoint_of_another_shape_stops_before_training(tokenizer_dir, tmp_path):
    from conftest import train

    qwen3_debug_checkpoint(tmp_path / "hf", n_layers=3)
    run = train(HF_START + ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--dump_folder", str(tmp_path / "run")],
                preflight=True)
    assert run.returncode == 2 and "n_layers=3, the flavor has 4" in run.output.strip().splitlines()[-1]
    assert not (tmp_path / "run" / "checkpoint").exists()
    # torchtitan ignores the initial load while checkpointing is off: refused, not a silent random start
    run = train(HF_START + ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.no-enable",
                            "--dump_folder", str(tmp_path / "off")], preflight=True)
    assert run.returncode == 2 and "ignored while checkpointing is off" in run.output.strip().splitlines()[-1]


def test_backbone_equals_torchtitans_qwen3_on_the_same_hf_weights(tmp_path):
    """torchtitan's qwen3 (fused qkv, q/k norm, head_dim 32 != 64 / 4, tied head), built at the
    checkpoint's shape from its own layer builder, reads the same Hugging Face file through its
    adapter: every weight loads and the logits equal ours."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import _build_qwen3_layers, _qwen3_norm, Qwen3Model
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    from torchtitan_ext.training.llama3_cpu_attention import use_cpu_attention
    from torchtitan_ext.hf_export import load_safetensors

    hf_checkpoint("qwen3_head_dim_32_tied", tmp_path)
    ours = load_hf_backbone(tmp_path).eval()
    c = ours.cfg
    rope = CosSinRoPE.Config(dim=c.head_dim, max_seq_len=c.max_seq_len, theta=c.rope_theta)
    config = Qwen3Model.Config(
        vocab_size=c.vocab_size, dim=c.dim, norm=_qwen3_norm(c.dim), enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=c.vocab_size, embedding_dim=c.dim),
        lm_head=Linear.Config(in_features=c.dim, out_features=c.vocab_size),
        layers=_build_qwen3_layers(n_layers=c.n_layers, dim=c.dim, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                                   head_dim=c.head_dim, hidden_dim=c.ffn_hidden, attn_backend="flex", rope=rope))
    use_cpu_attention(config)
    titan = config.build()
    titan.init_weights(buffer_device=None)
    loaded = titan.load_state_dict(Qwen3StateDictAdapter(config, None).from_hf(load_safetensors(tmp_path)), strict=False)
    assert not loaded.missing_keys and not loaded.unexpected_keys
    assert_same_logits(ours, titan)


# Qwen2 / Qwen2.5: MoNe's backbone (paper 004, appendix A.2)

QWEN2_START = ["--module", "train_configs.backbone", "--config", "backbone_qwen2_debug", "--checkpoint.initial_load_in_hf",
               "--validator.no-enable"]


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_exports_as_transformers_qwen2_and_reads_back(tied, tokenizer_dir, tmp_path):
    """A Qwen2 backbone with biases away from zero exports (hf_export.export) as a
    Qwen2ForCausalLM that transformers loads with the same logits (1e-4, fp32); the backbone
    reads the export back bit for bit. The export's sentencepiece tokenizer reads as training
    does through LlamaTokenizer (transformers' AutoTokenizer forces Qwen2's own on a qwen2 folder)."""
    from transformers import AutoModelForCausalLM, LlamaTokenizer

    from torchtitan_ext.data.tokenizer import AssetsTokenizer

    from torchtitan_ext.families.backbone import FAMILY
    from torchtitan_ext.hf_export import export
    from train_configs.backbone import backbone_qwen2_debug

    config = backbone_qwen2_debug()
    config.model_spec = FAMILY.model_spec("qwen2_debug", tie_embeddings=tied)
    torch.manual_seed(0)
    model = config.model_spec.model.build().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    export(model, config, tmp_path / "hf")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(reference).__name__ == "Qwen2ForCausalLM" and reference.config.tie_word_embeddings == tied
    tokens = torch.randint(0, 4096, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(reference(tokens).logits, model(tokens), rtol=0, atol=1e-4)
    original, back = model.state_dict(), load_hf_backbone(tmp_path / "hf").state_dict()
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    text = "Memory is written at test time, 2026."
    ours = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(tokenizer_dir))
    assert LlamaTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"] == ours.encode(text, add_bos=True, add_eos=False)


def test_lora_and_mone_on_qwen2_keep_the_qkv_biases_frozen_and_in_use():
    """MoNe with LoRA on W_q, W_k, W_v (its recipe) grafted on qwen2_debug: the wrapped
    projections keep their biases under the checkpoint's names, frozen; the block's output
    depends on them (memory tokens and tokens go through the biased W_k); a backward reaches
    the graft only."""
    from models.grafts.graft import GraftConfig
    from models.grafts.lora import LoRALinear
    from models.grafts.mone import MONE_LORA
    from torchtitan_ext.families.backbone import FAMILY

    graft = GraftConfig(kind="mone", layers="all", memory={"segment": 16}, lora=MONE_LORA)
    torch.manual_seed(0)
    model = DecoderLM(FAMILY.config("qwen2_debug", n_layers=2, graft=graft))
    attention = model.layers["0"].attention
    assert all(isinstance(w, LoRALinear) and w.bias is not None and not w.bias.requires_grad
               for w in (attention.wq, attention.wk, attention.wv))
    assert {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"} <= set(to_hf_keys(model.state_dict(), True))
    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n.endswith(".bias") and "memory" not in n)
    assert model.layers["0"].memory_gate.grad.abs().sum() > 0 and attention.wk.lora_B.weight.grad.abs().sum() > 0
    with torch.no_grad():
        attention.wk.bias.add_(1.0)
        assert not torch.allclose(model(tokens), logits)


def test_mone_qwen2_5_0_5b_fits_the_papers_widths_on_the_meta_device():
    """mone_qwen2_5_0_5b: Qwen2.5-0.5B (14 heads x 64, hidden 896, 2 kv heads, q/k/v biases,
    tied, 32K window) takes MoNe's H = 4 heads of d_h = 224 (appendix A.2) in all 24 blocks; the
    trainable parameters are the count from the shapes (memory + LoRA r128 on W_q, W_k, W_v per
    block), 6.3% of the 494M backbone (the paper: 6.4%); the recipe is mone_llama3_2_1b's."""
    from models.grafts.mone import MoNeBlock
    from train_configs.backbone import mone_llama3_2_1b, mone_qwen2_5_0_5b, QWEN2_5_0_5B_INSTRUCT

    config, llama = mone_qwen2_5_0_5b(), mone_llama3_2_1b()
    c = config.model_spec.model.model
    assert (c.architecture, c.dim, c.n_heads, c.head_dim, c.n_kv_heads, c.ffn_hidden, c.qkv_bias, c.tie_embeddings,
            c.max_seq_len) == ("qwen2", 896, 14, 64, 2, 4864, True, True, 32768)
    assert c.graft == llama.model_spec.model.model.graft
    assert (config.optimizer, config.lr_scheduler, config.training, config.dataloader) == (
        llama.optimizer, llama.lr_scheduler, llama.training, llama.dataloader)
    assert config.hf_assets_path == config.checkpoint.initial_load_path == QWEN2_5_0_5B_INSTRUCT
    assert config.checkpoint.initial_load_in_hf and config.dump_folder.endswith("mone_qwen2_5_0_5b")
    with torch.device("meta"):
        model = config.model_spec.model.build()
    blocks = list(model.layers.values())
    heads, d_h = c.graft.memory.heads, 224
    assert len(blocks) == 24 and all(isinstance(b, MoNeBlock) for b in blocks)
    assert heads == 4 and blocks[0].in_h == blocks[0].out_h == d_h
    query, kv, rank = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.graft.lora.rank
    # W_0 (three d_h x d_h per head), the gate, the q / k affines, the lr and beta projections, the output norm
    memory = 3 * heads * d_h * d_h + heads * d_h * d_h + 2 * 2 * query + 2 * (c.dim * heads + heads) + d_h
    lora = rank * (c.dim + query) + 2 * rank * (c.dim + kv)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert trainable == 24 * (memory + lora)
    assert abs(frozen / 0.494e9 - 1) < 0.005 and round(100 * trainable / frozen, 1) == 6.3


@pytest.mark.parametrize("case", ["weight", "hidden_size"])
def test_a_qwen2_folder_of_the_wrong_shape_is_one_line_and_exit_2(case, tokenizer_dir, tmp_path, capsys):
    """An initial load from a Qwen2 folder whose config.json is the flavor's but one weight has
    another width, or whose hidden size is not the flavor's, stops at train.sh's preflight
    (`python -m torchtitan_ext.training.preflight <train args>`, run here in-process) with one line and
    exit 2; load_hf_backbone raises the same error."""
    from safetensors.torch import load_file, save_file

    from torchtitan_ext.training import preflight
    from torchtitan_ext.families.backbone import FAMILY

    folder = tmp_path / "hf"
    if case == "weight":
        debug_checkpoint(folder, "qwen2_debug")
        key, file = "model.layers.1.self_attn.k_proj.bias", folder / "model.safetensors"
        state = load_file(file)
        state[key] = torch.zeros(state[key].shape[0] + 1)
        save_file(state, file, metadata={"format": "pt"})
        message = f"weight '{key}' has shape (65,), its config.json's model needs (64,)"
    else:
        debug_checkpoint(folder, "qwen2_debug", hidden_size=96)
        message = "dim=96, the flavor has 128"
    with pytest.raises(UserError, match=re.escape(message)):
        load_hf_backbone(folder, FAMILY.config("qwen2_debug"))
    capsys.readouterr()  # (what writing the folder printed)
    with pytest.raises(SystemExit) as stop:
        preflight.main(QWEN2_START + ["--checkpoint.initial_load_path", str(folder), "--dump_folder", str(tmp_path / "run")])
    logging.disable(logging.NOTSET)  # preflight.main silences torchtitan's warnings for the process
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


@pytest.mark.slow
def test_a_qwen2_folder_trains_exports_and_reloads_in_transformers(tokenizer_dir, tmp_path):
    """A random Qwen2 Hugging Face folder (biases and norms perturbed) trains 4 steps through
    scripts/train.sh from its weights (every tensor, biases included, moves by less than the
    steps allow); convert_to_hf.py exports the step-4 checkpoint as a Qwen2ForCausalLM that
    transformers loads with the trained model's logits (1e-4, fp32)."""
    from transformers import AutoModelForCausalLM

    from conftest import train
    from test_hf import run_script
    from torchtitan_ext.training.checkpoints import build_model, load_dcp_model

    debug_checkpoint(tmp_path / "hf", "qwen2_debug", perturb=True)
    run = train(QWEN2_START + ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--training.steps", "4",
                               "--checkpoint.interval", "4", "--dump_folder", str(tmp_path / "run")])
    assert run.returncode == 0 and sorted(run.losses) == [1, 2, 3, 4], run
    step = tmp_path / "run" / "checkpoint" / "step-4"
    model, _ = build_model("train_configs.backbone", "backbone_qwen2_debug")
    load_dcp_model(model, step)
    start, trained = load_hf_backbone(tmp_path / "hf").state_dict(), model.state_dict()
    assert all((trained[k] - start[k]).abs().max() < 0.05 for k in start)  # 4 AdamW steps at lr <= 3e-3
    assert not torch.equal(trained["layers.0.attention.wk.bias"], start["layers.0.attention.wk.bias"])

    assert run_script("convert_to_hf.py", "--module", "train_configs.backbone", "--config", "backbone_qwen2_debug",
                      "--checkpoint", step, "--out", tmp_path / "export") == 0
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(reloaded).__name__ == "Qwen2ForCausalLM"
    tokens = torch.randint(0, 4096, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (reloaded(tokens).logits - model.eval()(tokens)).abs().max() < 1e-4


def test_streaming_with_a_window_bounds_the_backbones_attention(tmp_path):
    """long_ppl's streaming entry with a window: the stream's attention keeps that many tokens
    (`stream_window`); a segment longer than the window is one clear error."""
    from torchtitan_ext.eval.long_ppl import load_entry

    qwen3_debug_checkpoint(tmp_path)
    config = "train_configs.backbone:backbone_qwen3_debug"
    bounded, _ = load_entry(str(tmp_path), config, "streaming", None, 64, None)
    unbounded, _ = load_entry(str(tmp_path), config, "streaming", None, None, None)
    assert (bounded.model.cfg.stream_window, unbounded.model.cfg.stream_window) == (64, 0)
    with pytest.raises(UserError, match="--segment 128 exceeds --window 64"):
        load_entry(str(tmp_path), config, "streaming", None, 64, 128)
