"""The FLOP counts behind the logged MFU (each family's `flops_per_token` in torchtitan_ext/families/<family>.py,
on the primitives of torchtitan_ext/flops.py) agree with torch's
FlopCounterMode over one training step (forward + backward) of each debug model, within 10%
(GradMem's second-order step too).

FlopCounterMode counts matmul-like ops only (mm, bmm, addmm, convolution, attention), as
our count does. Two adjustments: it counts a grouped convolution's backward as if the
convolution were dense (for the memories' depthwise q/k/v conv, 3 * inner times its
forward), so the conv backward is taken at twice the forward instead; and it has no formula
for the CPU flash-attention kernels SDPA picks here, so they get torch's own SDPA formulas.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from models.grafts.gradmem import GradMemLM
from models.lms.mela import Mela
from models.backbones.decoder_lm import DecoderLM
from models.grafts.graft import GraftConfig
from models.grafts.lora import LoRAConfig
from models.grafts.memory_llama import THESIS_MEMORY
from torchtitan_ext import flops
from torchtitan_ext.families import backbone, families, family_of_config, gradmem, mela, titans

# seq_len per family: Titans at its window (64 = 4 memory chunks of 16), Mela at 4 decoder
# chunks of P * C = 64, the MLP-FFN LM at 128. GradMem's rows are [context | read]: its own test below.
SEQ_LEN = {"titans": 64, "mela": 256, "mlp_lm": 128, "backbone": 128}
# (model class, plain config, seq_len) of every family with its own count, at its debug flavors.
CASES = {f"{spec_name}_{flavor}": (family.plain_class, family.config(flavor, **overrides), SEQ_LEN[family.name])
         for family in families().values() if family.flops_per_token and family.name in SEQ_LEN
         for spec_name, flavor, overrides in family.specs() if flavor.endswith("debug")} | {
    "backbone_qwen3_debug_lora": (DecoderLM, backbone.model_config("qwen3_debug", graft=GraftConfig(kind="lora")), 128),
    "backbone_llama_debug_memoryllama": (DecoderLM, backbone.model_config("llama_debug", graft=GraftConfig(
        kind="memoryllama", layers="alma", lora=LoRAConfig(rank=4), lora_layers="all", memory={"chunk_size": 32})), 128),
    "backbone_llama_debug_memoryllama_thesis": (DecoderLM, backbone.model_config("llama_debug", graft=GraftConfig(
        kind="memoryllama", layers="alma", memory=THESIS_MEMORY)), 128),
    "backbone_qwen3_debug_mone": (DecoderLM, backbone.model_config("qwen3_debug", graft=GraftConfig(
        kind="mone", layers="1,3", lora=LoRAConfig(rank=4, targets=("q", "k", "v")), memory={"segment": 32})), 128),
    "backbone_qwen3_debug_mone_partial": (DecoderLM, backbone.model_config("qwen3_debug", graft=GraftConfig(
        kind="mone", layers="all", memory={"segment": 48})), 128),
    "mela_debug_per_step_chain": (Mela, mela.model_config("debug", memory_chain="per_step"), 256),
    "mela_debug_memory_path_off": (Mela, mela.model_config("debug", memory_path=False), 256),
}


def measured_flops_per_token(model_cls, config, seq_len: int) -> float:
    torch.manual_seed(0)
    model = model_cls(config)
    tokens = torch.randint(0, config.vocab_size, (1, seq_len))
    with FlopCounterMode(display=False, custom_mapping=flops.CPU_ATTENTION_FLOPS) as counter:
        model(tokens).logsumexp(-1).mean().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    conv = counts.pop("aten.convolution", 0)
    counts.pop("aten.convolution_backward", None)
    return (sum(counts.values()) + 3 * conv) / seq_len


@pytest.mark.parametrize("name", sorted(CASES))
def test_count_matches_flop_counter_over_a_training_step(name):
    model_cls, config, seq_len = CASES[name]
    ratio = family_of_config(config).flops_per_token(config, seq_len) / measured_flops_per_token(model_cls, config, seq_len)
    assert abs(ratio - 1) < 0.1, ratio


def test_mela_count_follows_the_recursion_depth():
    """Two more H cycles (forward-only cycles) add what the count says they add."""
    _, config, seq_len = CASES["mela_debug"]
    deeper = dataclasses.replace(config, h_cycles=config.h_cycles + 2, memstack=False)
    shallow = dataclasses.replace(config, memstack=False)
    counted = mela.flops_per_token(deeper, seq_len) - mela.flops_per_token(shallow, seq_len)
    measured = measured_flops_per_token(Mela, deeper, seq_len) - measured_flops_per_token(Mela, shallow, seq_len)
    assert counted > 0.1 * mela.flops_per_token(shallow, seq_len)
    assert abs(counted / measured - 1) < 0.1, (counted, measured)


def test_torchtitan_reads_the_count():
    spec = titans.model_spec("debug", variant="mac").model
    with torch.device("meta"):
        model = spec.build()
    _, per_token = spec.get_nparams_and_flops(model, 64)
    assert per_token == titans.flops_per_token(spec.model, 64)


GRADMEM = {
    "gradient_k1": gradmem.model_config("kv_debug", gradmem={"write_steps": 1}),
    "gradient_k2": gradmem.model_config("kv_debug"),
    "gradient_k2_no_write_head": gradmem.model_config("kv_debug", gradmem={"write_head": False}),
    "gradient_k2_first_order": gradmem.model_config("kv_debug", gradmem={"meta_gradient": "first"}),
    "forward_k2": gradmem.model_config("kv_debug", gradmem={"write": "forward"}),
    "grafted_lora_frozen_backbone": gradmem.model_config("qwen3_debug", graft=GraftConfig(kind="lora")),
}


@pytest.mark.parametrize("name", sorted(GRADMEM))
def test_gradmem_count_matches_flop_counter_over_a_training_step(name):
    """A 16-pair KV row (114 context + 7 read tokens) through the write (second order for the
    gradient WRITE), the read and the outer backward: the row count within 1%, the seq_len
    count (the row taken as all context) within 10%."""
    config, context, read = GRADMEM[name], 114, 7
    torch.manual_seed(0)
    model = GradMemLM(config)
    tokens = torch.randint(0, config.vocab_size, (1, context + read))
    positions = torch.cat([torch.arange(context), torch.arange(read)])[None]
    with FlopCounterMode(display=False, custom_mapping=flops.CPU_ATTENTION_FLOPS) as counter:
        logits, write_loss = model(tokens, positions)
        (logits.logsumexp(-1).mean() + write_loss.sum()).backward()
    measured = counter.get_total_flops() / (context + read)
    assert abs(gradmem.row_flops(config, context, read) / measured - 1) < 0.01
    assert abs(family_of_config(config).flops_per_token(config, context + read) / measured - 1) < 0.1
