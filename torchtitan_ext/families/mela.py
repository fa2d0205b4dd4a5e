"""torchtitan spec for Mela (`models/lms/mela.py`).

Table 1 of the paper fixes H = L = 4 cycles, H-/L-module depths, HMM and decoder hidden
sizes, P = 32, C = 64 and the memory / language shares of the parameters; it leaves the
decoder depth and heads, and the HMM's attention key/value heads and memory-MLP width open.
We chose those so the shares match Table 1 (tests/test_mela.py checks within 2%; a 32K
vocabulary, tied embeddings, `scripts/param_counts.py` prints them):

| flavor | HMM dim / H, L blocks | kv heads, memory MLP | decoder dim x layers, heads / kv, ffn | memory | language | total |
| --- | --- | --- | --- | --- | --- | --- |
| debug | 128 / 2, 1 (H = L = 2, P = C = 8) | 4, x4 | 128 x 4, 4 / 4, 512 | 0.88M | 1.05M | 2.4M (4096 vocab) |
| 400m | 768 / 8, 4 | 12, x4 | 768 x 36, 12 / 6, 2048 | 98.3M (27.58%) | 233.6M (65.53%) | 356.5M |
| 800m | 1024 / 8, 8 | 8, x4 | 1024 x 36, 16 / 8, 3072 | 195.9M (28.74%) | 453.1M (66.46%) | 681.8M |
| 1b2 | 1024 / 8, 8 | 4, x2 | 1536 x 32, 24 / 6, 4096 | 187.0M (18.18%) | 792.8M (77.05%) | 1029.0M |

Table 1 gives 27.45 / 65.75, 28.78 / 66.35 and 18.19 / 76.97 percent. Its rest (6.80%, 4.87%,
4.84%) is one tied 32K embedding at each decoder width, which puts the paper's totals near
361M / 673M / 1016M, as ours. With one HMM design the 1.2B row (same HMM as the 800M, a
smaller memory share of a larger total) only fits with fewer HMM key/value heads and a
narrower memory MLP, so those differ per flavor.
"""

from __future__ import annotations

import dataclasses

from models.lms.mela import Mela, MelaConfig, MemoryModule, mela_diagnostics, mela_memory
from torchtitan_ext.families import Family
from torchtitan_ext import flops

PAPER = dict(vocab_size=32000, h_layers=8, h_cycles=4, l_cycles=4, patch_size=32, chunk_size=64)
FLAVORS = {
    "debug": dict(),
    "400m": dict(PAPER, dim=768, n_layers=36, n_heads=12, n_kv_heads=6, ffn_hidden=2048,
                 memory_dim=768, memory_heads=12, l_layers=4),
    "800m": dict(PAPER, dim=1024, n_layers=36, n_heads=16, n_kv_heads=8, ffn_hidden=3072,
                 memory_dim=1024, memory_heads=16, memory_kv_heads=8, l_layers=8),
    "1b2": dict(PAPER, dim=1536, n_layers=32, n_heads=24, n_kv_heads=6, ffn_hidden=4096,
                memory_dim=1024, memory_heads=16, memory_kv_heads=4, l_layers=8,
                memory=mela_memory(expansion=2)),
}

def flops_per_token(cfg: MelaConfig, seq_len: int) -> float:
    """Per text token. Decoder: every chunk of P*C text tokens runs with its C memory tokens
    (positions (P*C + C) / (P*C) per token), GQA attention over the chunk, SwiGLU, plus the
    diagnostic attention mass of the last 64 queries (forward only); output head. HMM (per
    patch, 1/P per token): patchify, then H cycles of L L-module steps and one H-module step,
    the first H-1 cycles forward only; each module step = input fusion MLP + its blocks
    (gated attention over the chunk's C patches, neural memory); the output fusions. Both
    memory chains run the same steps; with `memory_path=False` the HMM does not run."""
    d, m, p, c = cfg.dim, cfg.memory_dim, cfg.patch_size, cfg.chunk_size
    chunk = cfg.chunk_tokens + c
    kv = cfg.n_kv_heads * cfg.head_dim
    layer = 2 * flops.linear(d, d) + 2 * flops.linear(d, kv) + flops.attention_span(d, chunk) + 3 * flops.linear(d, cfg.ffn_hidden)
    decoder = flops.TRAIN * cfg.n_layers * layer * chunk / cfg.chunk_tokens
    decoder += flops.FORWARD_ONLY * cfg.n_layers * 2 * min(64, chunk) * chunk * d / cfg.chunk_tokens
    decoder += flops.TRAIN * flops.linear(d, cfg.vocab_size)

    memory_kv = cfg.memory_kv_heads * (m // cfg.memory_heads)
    block = 0.0
    if cfg.memory_attention:
        block += 2 * flops.linear(m, m) + 2 * flops.linear(m, memory_kv) + flops.attention_span(m, c)
        block += flops.linear(m, m) if cfg.attention_gating else 0
    if cfg.neural_memory:
        block += flops.neural_memory(cfg.block_memory)
    fusion_in = flops.linear(2 * m, m) + flops.linear(m, m)
    l_step, h_step = fusion_in + cfg.l_layers * block, fusion_in + cfg.h_layers * block
    cycle = cfg.l_cycles * l_step + h_step
    output_fusion = flops.linear(2 * m, m) + flops.linear(m, d) if cfg.fusion == "mlp" else (flops.linear(m, d) if m != d else 0)
    fusions = cfg.h_cycles if cfg.memstack else 1
    hmm_per_patch = flops.FORWARD_ONLY * (cfg.h_cycles - 1) * cycle + flops.TRAIN * (cycle + fusions * output_fusion)
    hmm_per_patch += flops.TRAIN * flops.linear(m * p, m)  # patchify: a stride-P conv over P tokens
    hmm = hmm_per_patch / p + (flops.TRAIN * flops.linear(d, m) if m != d else 0)
    return decoder + (hmm if cfg.memory_path else 0.0)


# Graphs the HMM's compiled modules may need (dynamo's default limit is 8): the recursion calls
# them with grad on (the last cycle) and off (HRM's earlier cycles); `models.lms.mela.uniform_call`
# gives every call of one grad mode the same requires_grad and strides, so a training step and
# an evaluation compile 4 graphs (L- and H-module x grad on / off; 9 before it: tests/test_mela.py).
# The margin is for other shapes in one process (a stream's partial chunks, another batch).
HMM_RECOMPILE_LIMIT = 16


def hmm_modules(model) -> list[str]:
    """Names of the HMM's L- and H-modules (`MemoryModule`: input fusion, memory blocks, norm)."""
    return [name for name, module in model.named_modules() if isinstance(module, MemoryModule)]


def compiled_modules(model) -> list[str]:
    """What Mela's training compiles: torchtitan's per-block compile of the decoder `layers`,
    and the HMM's L- and H-module (`compile_hmm`)."""
    return [f"layers.{key}" for key, _ in model.layers.named_children()] + hmm_modules(model)


def compile_hmm(model, backend: str) -> None:
    """Compile the HMM's L- and H-module each with fullgraph=True (input fusion, memory
    blocks with their attention and neural memories, norm; the recursion and patchify
    between them stay eager), allowing HMM_RECOMPILE_LIMIT graphs per module (grad on / off
    cycles, fresh / carried states)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, HMM_RECOMPILE_LIMIT)
    for name in hmm_modules(model):
        model.get_submodule(name).compile(backend=backend, fullgraph=True)


def compile_regions(model, backend: str) -> None:
    """Every module of `compiled_modules`, as training compiles them (scripts/bench_models.py)."""
    compile_hmm(model, backend)
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=True)


def parallelize_mela(model, *, parallel_dims, training, parallelism, compile_config, ac_config, dump_folder):
    """With compile on, the HMM's L- and H-module (`compile_hmm`), then torchtitan's AC ->
    per-block compile of the decoder `layers` -> FSDP2 (`parallelize_plain_decoder`)."""
    from torchtitan_ext.families.plain_model import parallelize_plain_decoder

    if compile_config.enable:
        compile_hmm(model, compile_config.backend)
    return parallelize_plain_decoder(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                     compile_config=compile_config, ac_config=ac_config, dump_folder=dump_folder)


def mela_spec(flavor: str, **overrides):
    """The family's ModelSpec: the plain-model spec with `parallelize_mela`."""
    from torchtitan_ext.families.plain_model import plain_model_spec, torchtitan_model

    config = FAMILY.config(flavor, **overrides)
    spec = plain_model_spec(FAMILY.spec_name(config), flavor, torchtitan_model(Mela, MelaConfig, flops_per_token), config)
    return dataclasses.replace(spec, parallelize_fn=parallelize_mela)


FAMILY = Family(name="mela", summary="Mela: Transformer++ decoder reading a Hierarchical Memory Module (arXiv:2605.10537)",
                flavors=FLAVORS, config_class=MelaConfig, plain_class=Mela, flops_per_token=flops_per_token,
                diagnostics=mela_diagnostics, build_spec=mela_spec, compile_regions=compile_regions,
                compiled_modules=compiled_modules)
model_config, model_spec = FAMILY.config, FAMILY.model_spec
