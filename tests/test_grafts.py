"""Grafts on the pretrained backbone: LoRA (models/grafts/lora.py) against peft."""

from __future__ import annotations

import torch

from models.grafts.lora import apply_lora, LoRAConfig, LoRALinear, merge_lora, TARGETS
from test_backbone import hf_checkpoint
from torchtitan_ext.backbone import load_hf_backbone

HF_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))


def test_lora_at_init_is_the_backbone_exactly_and_keeps_the_weight_names(tmp_path):
    hf_checkpoint("qwen3_head_dim_32_tied", tmp_path)
    base, adapted = load_hf_backbone(tmp_path).eval(), load_hf_backbone(tmp_path).eval()
    apply_lora(list(adapted.layers.values()), LoRAConfig(rank=4))
    with torch.no_grad():
        assert torch.equal(adapted(TOKENS), base(TOKENS))
    assert set(base.state_dict()) < set(adapted.state_dict())  # backbone keys unchanged, factors added
    added = set(adapted.state_dict()) - set(base.state_dict())
    assert added == {f"layers.{i}.{TARGETS[t]}.lora_{f}.weight" for i in range(2) for t in TARGETS for f in "AB"}


def test_lora_equals_peft_and_merges(tmp_path):
    from peft import get_peft_model
    from peft import LoraConfig as PeftLoraConfig

    reference = hf_checkpoint("llama_gqa_untied", tmp_path)
    ours = load_hf_backbone(tmp_path).eval()
    cfg = LoRAConfig(rank=4, alpha=8.0, dropout=0.0)
    apply_lora(list(ours.layers.values()), cfg)
    peft_model = get_peft_model(reference, PeftLoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[
        HF_NAMES[t].split(".")[1] for t in cfg.targets])).eval()
    torch.manual_seed(2)
    with torch.no_grad():
        for i, layer in enumerate(ours.layers.values()):
            for target in cfg.targets:
                module = layer.get_submodule(TARGETS[target])
                theirs = peft_model.base_model.model.model.layers[i].get_submodule(HF_NAMES[target])
                for factor in ("A", "B"):
                    value = torch.randn_like(getattr(module, f"lora_{factor}").weight) * 0.1
                    getattr(module, f"lora_{factor}").weight.copy_(value)
                    getattr(theirs, f"lora_{factor}")["default"].weight.copy_(value)
        expected = peft_model(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS), expected, rtol=0, atol=1e-4)
        assert (expected - load_hf_backbone(tmp_path)(TOKENS)).abs().max() > 1e-3  # the factors do change the model
        merge_lora(ours)
        assert not any(isinstance(m, LoRALinear) for m in ours.modules())
        torch.testing.assert_close(ours(TOKENS), expected, rtol=0, atol=1e-4)
