"""The pretrained backbone (models/backbones/decoder_lm.py) against transformers' Llama and
Qwen3 and torchtitan's llama3 and qwen3, loaded from the same tiny random Hugging Face checkpoints."""

from __future__ import annotations

import pytest
import torch

from models.backbones.decoder_lm import DecoderLM, DecoderLMConfig
from torchtitan_ext.backbone import from_hf_keys, load_hf_backbone, to_hf_keys
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
}


def hf_checkpoint(case: str, folder):
    """A tiny random transformers model of `case`, saved to `folder`; returns it (fp32, eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    kind, fields = CASES[case]
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if kind == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    torch.manual_seed(0)
    model = model_cls(config_cls(**SHAPE, **fields)).eval()
    with torch.no_grad():  # norms away from one, so that a missed norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model


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
    from torchtitan_ext.backbone import check_matches, FAMILY, hf_config

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
    for flavor, hub in (("llama3_2_1b", llama), ("qwen3_0_6b", qwen3)):
        expected = FAMILY.config(flavor)
        check_matches(expected, config_from_hf(hub), "hub")
        check_matches(expected, config_from_hf(hf_config(expected).to_dict() | {"model_type": hub["model_type"]}),
                      "transformers 5")


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
    from torchtitan_ext.transformer import llama3_config, Shape

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



# The model cards' figures: Llama 3.2 1B "1.23B"; Qwen3-0.6B "0.6B, non-embedding 0.44B";
# Qwen3-1.7B "1.7B, non-embedding 1.4B".
PUBLISHED = {"llama3_2_1b": (1.23e9, None), "qwen3_0_6b": (0.6e9, 0.44e9), "qwen3_1_7b": (1.7e9, 1.4e9)}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_pretrained_flavors_have_the_published_sizes(flavor):
    from torchtitan_ext.backbone import FAMILY

    with torch.device("meta"):
        model = DecoderLM(FAMILY.config(flavor))
    total = sum(p.numel() for p in model.parameters())
    total_claimed, body_claimed = PUBLISHED[flavor]
    assert abs(total / total_claimed - 1) < 0.02
    if body_claimed:
        assert abs((total - model.tok_embeddings.weight.numel()) / body_claimed - 1) < 0.02


def qwen3_debug_checkpoint(folder, n_layers: int | None = None):
    """A random transformers Qwen3 of the `qwen3_debug` flavor's shape (or another depth)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from torchtitan_ext.backbone import FAMILY

    c = FAMILY.config("qwen3_debug")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_hidden, num_hidden_layers=n_layers or c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
        rms_norm_eps=c.norm_eps, tie_word_embeddings=True, max_position_embeddings=c.max_seq_len)).save_pretrained(folder)


HF_START = ["--module", "train_configs.backbone", "--config", "backbone_qwen3_debug", "--checkpoint.initial_load_in_hf",
            "--validator.no-enable"]


@pytest.mark.slow
def test_training_starts_from_a_hugging_face_checkpoint(tokenizer_dir, tmp_path):
    """`--checkpoint.initial_load_in_hf` reads the weights through the backbone's adapter: at
    learning rate 0 the step-2 checkpoint holds the file's tensors bit for bit; at the debug
    learning rate 20 steps lower the loss."""
    from conftest import train
    from torchtitan_ext.checkpoints import build_model, load_dcp_model

    qwen3_debug_checkpoint(tmp_path / "hf")
    frozen = train(HF_START + ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--optimizer.param-groups.0.optimizer-kwargs.lr", "0",
                               "--training.steps", "2", "--checkpoint.interval", "2", "--dump_folder", str(tmp_path / "a")])
    assert frozen.returncode == 0, frozen
    model, _ = build_model("train_configs.backbone", "backbone_qwen3_debug")
    load_dcp_model(model, tmp_path / "a" / "checkpoint" / "step-2")
    source = load_hf_backbone(tmp_path / "hf").state_dict()
    assert all(torch.equal(value, source[key]) for key, value in model.state_dict().items())

    tuned = train(HF_START + ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--training.steps", "20",
                              "--dump_folder", str(tmp_path / "b")])
    assert tuned.returncode == 0, tuned
    assert tuned.losses[20] < tuned.losses[1] - 0.5


def test_an_hf_checkpoint_of_another_shape_stops_before_training(tokenizer_dir, tmp_path):
    from conftest import train

    qwen3_debug_checkpoint(tmp_path / "hf", n_layers=3)
    run = train(HF_START + ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--dump_folder", str(tmp_path / "run")])
    assert run.returncode == 2 and "n_layers=3, the flavor has 4" in run.output.strip().splitlines()[-1]
    assert not (tmp_path / "run" / "checkpoint").exists()
    # torchtitan ignores the initial load while checkpointing is off: refused, not a silent random start
    run = train(HF_START + ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.no-enable",
                            "--dump_folder", str(tmp_path / "off")])
    assert run.returncode == 2 and "ignored while checkpointing is off" in run.output.strip().splitlines()[-1]


def test_backbone_equals_torchtitans_qwen3_on_the_same_hf_weights(tmp_path):
    """torchtitan's qwen3 (fused qkv, q/k norm, head_dim 32 != 64 / 4, tied head), built at the
    checkpoint's shape from its own layer builder, reads the same Hugging Face file through its
    adapter: every weight loads and the logits equal ours."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import _build_qwen3_layers, _qwen3_norm, Qwen3Model
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    from torchtitan_ext.attention import use_cpu_attention
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
