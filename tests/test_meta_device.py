"""Every model family runs forward and backward off the CPU: built and run on the meta
device, in fp32 and bf16, so a tensor made on the CPU inside a model (a module-level
constant, an `arange` without `device=`) fails here as it would on a GPU.

The meta device takes the non-CUDA branches of `models/layers/attention.py` (dense SDPA masks):
flex attention's block masks need real CUDA tensors, so the GPU attention path is checked
by `scripts/gpu_check.sh` on a GPU. Titans and Mela also stream on meta; the neural memory's
fast-weight state must come out float32 under a bf16 model. A new family is one line of
FAMILIES.
"""

from __future__ import annotations

import pytest
import torch
from torchtitan.models.common.attention import create_varlen_metadata_for_document

from kernels import memory_update, newton_schulz
from models.backbones.decoder_lm import DecoderLM, DecoderLMConfig
from models.grafts.graft import GraftConfig
from models.lms.mela import Mela, MelaConfig, mela_memory
from models.lms.mlp_lm import MLPLM, MLPLMConfig
from models.lms.titans import TitansConfig, TitansLM, VARIANTS
from models.memory.neural_memory import NeuralMemoryConfig
from torchtitan_ext.families import transformer

VOCAB, LENGTH = 64, 40


def titans(variant: str):
    # Paper ratios at small width: memory chunk 64 : window 512 = 4 : 32, recompute groups on.
    return TitansLM(TitansConfig(variant=variant, vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, window=32,
                                 memory=NeuralMemoryConfig(chunk_size=4, checkpoint_chunks=2)))


def mela(**fields):
    # P * C = 8 tokens: LENGTH = 5 decoder chunks.
    return Mela(MelaConfig(vocab_size=VOCAB, dim=32, n_layers=3, n_heads=2, memory_heads=2, patch_size=2,
                           chunk_size=4, memory=mela_memory(expansion=2), **fields))


def mlp_lm():
    return MLPLM(MLPLMConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64))


def backbone(graft: GraftConfig | None = None):
    # Qwen3's shape ratios at small width: head_dim 16 with dim 32 / 4 heads, q/k norm, tied, GQA.
    return DecoderLM(DecoderLMConfig(architecture="qwen3", vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4,
                                     n_kv_heads=2, head_dim=16, ffn_hidden=64, qk_norm=True, tie_embeddings=True,
                                     graft=graft or GraftConfig()))


def memoryllama():
    # The 1B configs' ratio: 2048 tokens / chunks of 64 = 32 chunks; here 40 / 8 = 5, a memory in each block.
    return backbone(GraftConfig(kind="memoryllama", layers="all", memory={"chunk_size": 8}, lora={"rank": 2}))


def mone():
    # The paper's ratio: 4096-token training contexts / segments of 512 = 8; here 40 / 5, every block, LoRA on q, k, v.
    return backbone(GraftConfig(kind="mone", layers="all", memory={"segment": 5},
                                lora={"rank": 2, "targets": ("q", "k", "v")}))


class TransformerPP(torch.nn.Module):
    """torchtitan's llama3 (the Transformer++ flavor `debug`, our CPU attention) called as
    the trainer calls it: one document per row. The document offsets come from data
    (`nonzero`), which meta cannot compute: they are made on the CPU and moved to meta."""

    def __init__(self):
        super().__init__()
        self.model = transformer.model_config("debug", attn_backend="cpu").build()
        self.model.init_weights(buffer_device=None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.device("cpu"):
            masks = create_varlen_metadata_for_document(torch.arange(tokens.shape[1]).expand(tokens.shape))
        masks = masks._replace(cu_seq_q=masks.cu_seq_q.to(tokens.device), cu_seq_k=masks.cu_seq_k.to(tokens.device))
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.model(tokens, positions=positions, attention_masks=masks)


FAMILIES = {f"titans_{v}": (lambda v=v: titans(v)) for v in VARIANTS} | {
    "mela": mela, "mela_per_step_chain": lambda: mela(memory_chain="per_step"), "mlp_lm": mlp_lm,
    "transformer": TransformerPP, "backbone": backbone, "memoryllama": memoryllama, "mone": mone}
STREAMING = {name for name in FAMILIES if name.startswith(("titans", "mela", "backbone", "memoryllama", "mone"))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forward_and_backward_on_the_meta_device(family, dtype):
    with torch.device("meta"):
        model = FAMILIES[family]().to(dtype)
        tokens = torch.randint(0, VOCAB, (2, LENGTH))
        logits = model(tokens)
        logits.float().logsumexp(-1).mean().backward()
    assert logits.device.type == "meta" and logits.dtype == dtype and logits.shape[:2] == (2, LENGTH)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.device.type == "meta" for g in grads)
    if family in STREAMING:
        with torch.device("meta"), torch.no_grad():
            _, state = model.stream(tokens[:, :32])
            streamed, _ = model.stream(tokens[:, 32:], state)
        assert streamed.device.type == "meta" and streamed.shape[1] == LENGTH - 32
    if hasattr(getattr(model, "cfg", None), "stream_window"):  # a backbone or graft: the bounded stream too
        model.cfg.stream_window = 24
        with torch.device("meta"), torch.no_grad():
            state = None
            for start in range(0, LENGTH, 8):
                streamed, state = model.stream(tokens[:, start:start + 8], state)
        assert streamed.device.type == "meta" and state.seen == LENGTH


def test_fast_weight_state_is_float32_under_a_bf16_model_on_meta():
    with torch.device("meta"):
        model = titans("mag").to(torch.bfloat16)
        _, state = model.stream(torch.randint(0, VOCAB, (2, LENGTH)))
    memory = state.layers[0].memory
    assert {t.dtype for t in memory.weights + memory.momentum + memory.pending} == {torch.float32}
    with torch.device("meta"):
        _, state = mone().to(torch.bfloat16).stream(torch.randint(0, VOCAB, (2, LENGTH)))
    cache = state.caches[0]
    assert {t.dtype for t in cache.weights + cache.momentum} == {torch.float32} and cache.keys.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_kernel_dispatch_runs_on_meta(backend, dtype):
    """'auto' must pick the torch reference for a non-CUDA device (meta included), not a
    Triton kernel and not a CPU detour; output keeps device, dtype and shape."""
    with torch.device("meta"):
        x = torch.randn(2, 3, 16, 48, dtype=dtype, requires_grad=True)
        out = newton_schulz(x, 5, backend=backend)
        out.float().sum().backward()
        weight, momentum, grad = (torch.randn(2, 3, 16, 48, dtype=dtype) for _ in range(3))
        eta, alpha = torch.rand(2, 3), torch.rand(2, 3)
        new_weight, new_momentum = memory_update(weight, momentum, grad, eta, alpha, 5, backend=backend)
    assert out.device.type == "meta" and out.dtype == dtype and out.shape == x.shape
    assert x.grad is not None and x.grad.device.type == "meta"
    assert new_weight.device.type == new_momentum.device.type == "meta" and new_weight.shape == weight.shape
