"""The FLOP counts behind the logged MFU (each family's `flops_per_token` in torchtitan_ext/families/<family>.py,
on the primitives of models/layers/flops.py) agree with torch's
FlopCounterMode over one training step (forward + backward) of each debug model, within 10%
(GradMem's second-order step too); the graft table's FLOP column (models/grafts/graft.py)
equals counts written out by hand from the weights' shapes, and Locas' row what
FlopCounterMode sees a forward gain.

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
from models.grafts.graft import GRAFT_KINDS, GraftConfig
from models.grafts.lora import LoRAConfig
from models.grafts.memory_llama import THESIS_MEMORY
from models.memory.gradmem import row_flops
from models.memory.locas import LocasConfig
from torchtitan_ext import flops
from torchtitan_ext.families import backbone, families, family_of_config, gradmem, mela, mlp_lm, titans

# seq_len per family: Titans at 4 windows (256 = 4 MAC segments of 4 memory chunks of 16: MAC folds
# two weight products once per call, `TitansBlock._mac`, an implementation cost the count leaves out:
# 11% of the measured at one segment, 2% at four), Mela at 4 decoder chunks of P * C = 64, the MLP-FFN
# LM at 128. GradMem's rows are [context | read]: its own test below.
SEQ_LEN = {"titans": 256, "mela": 256, "mlp_lm": 128, "backbone": 128}
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
    assert abs(row_flops(config, context, read) / measured - 1) < 0.01
    assert abs(family_of_config(config).flops_per_token(config, context + read) / measured - 1) < 0.1


# The graft table's FLOP column (models/grafts/graft.py), against counts written out by hand
# for the debug shapes: 2 FLOPs per weight of every product, from the shapes of the weights.
def backbone_forward(d, q, kv, ffn, n_layers, vocab, seq_len):
    """One token through the plain backbone: per block W_q, W_o (d x q), W_k, W_v (d x kv),
    gate, up, down (d x ffn), attention over seq_len keys; the head (d x vocab)."""
    return n_layers * (2 * 2 * d * q + 2 * 2 * d * kv + 3 * 2 * d * ffn + 4 * q * seq_len) + 2 * d * vocab


def lora_forward(shapes, targets, rank, blocks):
    """A (d_in x r) then B (r x d_out) per target and block."""
    return blocks * sum(2 * shapes[t][0] * rank + 2 * rank * shapes[t][1] for t in targets)


def memoryllama_by_hand(seq_len, chunk, lora_rank):
    """llama_debug (d 128, 4 blocks, q 128, kv 64, FFN 384) with MemoryLlama in the last two
    blocks (default memory: one head, M = (d x 2d)(2d x d), Newton-Schulz 5 steps per chunk)
    -> (row's (backbone, graft), family total). Per grafted block and token: the memory's
    write: W_qkv (d x 3d) 6d^2, gates (d x 3) 6d, W_out 2d^2, M on q and k and its
    transpose-product gradient 3 x 8d^2, the back-product through the last matrix 4d^2,
    Newton-Schulz on both matrices 2 x 5 x 10 d^3 per chunk; the read of h: W_q 2d^2 + M 8d^2
    + out 2d^2; W_DP (2d x d) 4d^2; W_g 2d^2. Attention: (seq_len + C) / 2 keys in place of
    seq_len. The last chunk's write: forward only (2 of its 3 passes taken off)."""
    d, q, kv, ffn, n_layers, vocab = 128, 128, 64, 384, 4, 4096
    per_block = 54 * d**2 + 6 * d + 100 * d**3 / chunk
    graft = 2 * per_block - (2 * (2 / 3) * 100 * d**3 / seq_len if seq_len % chunk == 0 else 0)
    changed = -2 * 4 * q * (seq_len - (seq_len + chunk) / 2)
    shapes = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, ffn), "up": (d, ffn), "down": (ffn, d)}
    lora = lora_forward(shapes, shapes, lora_rank, n_layers)
    total = 2 * (backbone_forward(d, q, kv, ffn, n_layers, vocab, seq_len) + changed) + 3 * (lora + graft)
    return (changed, graft), total


def mone_by_hand(seq_len, segment, layers, lora_rank):
    """qwen3_debug (d 128, 4 blocks, q 256, kv 128, FFN 384) with MoNe (4 heads: per head M =
    SwiGLU (64 x 64, 64 x 64, 64 x 32), gate (64 x 32); per-token lr (d x 4)) in `layers`
    blocks -> (row's (backbone, graft), family total). Per block and token: M's read, the
    gate, the lr; the write per full segment (M forward + the explicit gradient's products
    (hidden x out) x 2, (in x hidden) x 2) over its tokens, forward only (1 of 3 passes) for
    the last segment when nothing reads it; W_k, W_v again and LoRA on k, v for the memory
    tokens; attention over 2T keys in place of seq_len."""
    d, q, kv, ffn, n_layers, vocab, heads, inner, hidden, out = 128, 256, 128, 384, 4, 4096, 4, 64, 64, 32
    swiglu = heads * (2 * 2 * inner * hidden + 2 * hidden * out)
    read = swiglu + heads * 2 * inner * out + 2 * d * heads
    write = swiglu + heads * (2 * 2 * hidden * out + 2 * 2 * inner * hidden)
    full = seq_len // segment
    read_later = full - 1 if seq_len % segment == 0 else full
    write_per_token = write * segment * (read_later + (full - read_later) / 3) / seq_len
    lora_on_memory = 2 * (2 * d * lora_rank + 2 * lora_rank * kv) if lora_rank else 0
    graft = layers * (read + write_per_token + lora_on_memory)
    changed = layers * (2 * 2 * d * kv + 4 * q * 2 * segment - 4 * q * seq_len)
    shapes = {"q": (d, q), "k": (d, kv), "v": (d, kv)}
    lora = lora_forward(shapes, shapes, lora_rank, layers) if lora_rank else 0
    total = 2 * (backbone_forward(d, q, kv, ffn, n_layers, vocab, seq_len) + changed) + 3 * (lora + graft)
    return (changed, graft), total


GRAFTED = {  # name: (config, seq_len, by hand)
    "memoryllama_chunks_fit": (backbone.model_config("llama_debug", graft=GraftConfig(
        kind="memoryllama", layers="alma", lora=LoRAConfig(rank=4), lora_layers="all", memory={"chunk_size": 32})),
        128, memoryllama_by_hand(128, 32, 4)),
    "memoryllama_last_chunk_partial": (backbone.model_config("llama_debug", graft=GraftConfig(
        kind="memoryllama", layers="alma", lora=LoRAConfig(rank=8), lora_layers="all", memory={"chunk_size": 32})),
        100, memoryllama_by_hand(100, 32, 8)),
    "mone_segments_fit": (backbone.model_config("qwen3_debug", graft=GraftConfig(
        kind="mone", layers="1,3", lora=LoRAConfig(rank=4, targets=("q", "k", "v")), memory={"segment": 32})),
        128, mone_by_hand(128, 32, 2, 4)),
    "mone_last_segment_partial": (backbone.model_config("qwen3_debug", graft=GraftConfig(
        kind="mone", layers="all", memory={"segment": 48})), 128, mone_by_hand(128, 48, 4, 0)),
}


@pytest.mark.parametrize("name", sorted(GRAFTED))
def test_a_block_kinds_row_counts_what_its_blocks_change_and_the_family_adds_it(name):
    config, seq_len, ((changed, graft), total) = GRAFTED[name]
    assert GRAFT_KINDS[config.graft.kind].flops(config, seq_len) == pytest.approx((changed, graft), rel=1e-12)
    assert backbone.flops_per_token(config, seq_len) == pytest.approx(total, rel=1e-12)


def test_lora_alone_is_the_backbone_frozen_plus_its_factors():
    """Kind "lora" has no memory row count: the family's count is the frozen backbone (2x) and
    the factors on every block (3x)."""
    config = backbone.model_config("qwen3_debug", graft=GraftConfig(kind="lora"))
    d, q, kv, ffn, r = 128, 256, 128, 384, 16
    shapes = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, ffn), "up": (d, ffn), "down": (ffn, d)}
    assert GRAFT_KINDS["lora"].flops is None
    assert backbone.flops_per_token(config, 64) == (2 * backbone_forward(d, q, kv, ffn, 4, 4096, 64)
                                                    + 3 * lora_forward(shapes, shapes, r, 4))


def gradmem_by_hand(write, steps, context):
    """kv_debug (d 64, 2 blocks, q = kv = 64, FFN 256, vocab 70, m = 8, everything trained)
    per token of a row of `context` tokens. Forward WRITE: per step a trained step (3
    passes) over [M; C; M]. Gradient WRITE, second order: per step over [M; C] the linears 6
    passes (forward, inner gradient, the outer backward's 2 + 2), attention 9 (1 + 2 + 2 + 4),
    the LM head 6 and the WRITE head (its Delta) 6 over the context. The read (m tokens, no
    query here) and the head over the row: trained steps."""
    d, q, kv, ffn, n_layers, vocab, m = 64, 64, 64, 256, 2, 70, 8
    lin = n_layers * (2 * 2 * d * q + 2 * 2 * d * kv + 3 * 2 * d * ffn)
    head = 2 * d * vocab

    def att(span):
        return n_layers * 4 * q * span

    if write == "forward":
        span = 2 * m + context
        per_step = span * 3 * (lin + att(span))
    else:
        span = m + context
        per_step = span * (6 * lin + 9 * att(span)) + context * (6 * head + 6 * head)
    return (steps * per_step + m * 3 * (lin + att(m))) / context + 3 * head


@pytest.mark.parametrize("write,steps", [("forward", 1), ("forward", 2), ("gradient", 2)])
def test_the_gradmem_row_is_its_familys_count(write, steps):
    config = gradmem.model_config("kv_debug", gradmem={"write": write, "write_steps": steps})
    assert gradmem.FAMILY.flops_per_token is GRAFT_KINDS["gradmem"].flops
    assert GRAFT_KINDS["gradmem"].flops(config, 121) == pytest.approx(gradmem_by_hand(write, steps, 121), rel=1e-12)


@pytest.mark.parametrize("cfg", [LocasConfig(variant="glu", rank=8, layers="1,3"),
                                 LocasConfig(variant="mlp", rank=8, update="nlsvd")], ids=["glu", "mlp_nlsvd"])
def test_the_locas_row_counts_the_attached_memories_forward(cfg):
    """What FlopCounterMode sees a forward gain once the memories are attached (Locas-GLU on
    the debug Llama's SwiGLU FFNs, Locas-MLP with "nlsvd" at its widest, 2r slots, on the
    debug MLP-FFN LM's), and by hand: G, K, V (d x r) or K, V (d x 2r) per block."""
    family = backbone if cfg.variant == "glu" else mlp_lm
    model = family.FAMILY.plain_class(family.model_config("llama_debug" if cfg.variant == "glu" else "debug")).eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 16))

    def forward_flops():
        with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=flops.CPU_ATTENTION_FLOPS) as counter:
            model(tokens)
        return counter.get_total_flops() / tokens.shape[1]

    plain = forward_flops()
    for sideways in GRAFT_KINDS["locas"].build(model, cfg):
        if cfg.variant == "mlp":
            sideways.memory.set_slots(*(torch.zeros(2 * cfg.rank, model.cfg.dim) for _ in range(2)))
    counted = GRAFT_KINDS["locas"].flops(cfg, model.cfg.n_layers, model.cfg.dim)
    d, r = model.cfg.dim, cfg.rank
    blocks = 2 if cfg.variant == "glu" else 4
    assert counted == blocks * (3 * 2 * d * r if cfg.variant == "glu" else 2 * 2 * d * 2 * r)
    assert forward_flops() - plain == counted
