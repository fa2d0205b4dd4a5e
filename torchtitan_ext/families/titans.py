"""torchtitan specs for the Titans models of `models/lms/titans.py` (MAC, MAG, MAL, LMM).

The Titans paper names sizes (170M, 400M, 760M) but not shapes. Ours: 32K vocabulary,
untied embeddings, head_dim 64, SwiGLU FFN, memory depth 2 with expansion 4, window
(= MAC segment) 512, 4 persistent tokens, memory chunk 64 with the paper's per-token gate
rule, q/k/v conv, output norm and gate, and the paper's MAC/MAG gate. Parameters
(`scripts/param_counts.py`; MAC, MAG and MAL agree within 0.1M: the paper gate's two norms
vs MAL's extra norm; LMM has no attention):

| flavor | dim | layers | heads | MAC / MAG / MAL | LMM |
| --- | --- | --- | --- | --- | --- |
| debug | 128 | 2 | 2 | 1.8M | 1.7M (4096 vocab, window 64, chunk 16) |
| 170m | 768 | 12 | 12 | 167.7M | 139.4M |
| 400m | 1024 | 19 | 16 | 400.9M | 321.1M |
| 760m | 1536 | 17 | 24 | 756.4M | 595.8M |
"""

from __future__ import annotations

import dataclasses

from models.memory.neural_memory import NeuralMemoryConfig
from models.lms.titans import memory_diagnostics, TitansConfig, TitansLM, VARIANTS
from torchtitan_ext.families import Family
from torchtitan_ext import flops

# Recomputing groups of 4 chunks in backward keeps 4.9x fewer bytes per token for ~17% more
# memory-layer time (scripts/bench_memory.py): 760m at B=8 x T=4K keeps 63 GiB instead of 306 GiB.
PAPER = dict(vocab_size=32000, window=512, n_persistent=4, max_seq_len=131072,
             memory=NeuralMemoryConfig(chunk_size=64, checkpoint_chunks=4))
FLAVORS = {
    "debug": dict(vocab_size=4096, dim=128, n_layers=2, n_heads=2, window=64, memory=NeuralMemoryConfig(chunk_size=16)),
    "170m": dict(PAPER, dim=768, n_layers=12, n_heads=12),
    "400m": dict(PAPER, dim=1024, n_layers=19, n_heads=16),
    "760m": dict(PAPER, dim=1536, n_layers=17, n_heads=24),
}

def flops_per_token(cfg: TitansConfig, seq_len: int) -> float:
    """Per token: each block's memory, attention (MAC: keys are the segment's retrieved
    tokens and inputs plus the persistent tokens; MAG/MAL: the window and the persistent
    tokens), gate and SwiGLU FFN; the output head. The model's math: MAC's two weight folds
    per call (`TitansBlock._mac`, an implementation choice) are left out (at 400m, T 4096,
    batch 2: about 2% of the step's executed FLOPs)."""
    d, memory = cfg.dim, cfg.block_memory
    block = flops.neural_memory(memory) + 3 * flops.linear(d, cfg.ffn_hidden)
    if cfg.variant == "mac":
        segment = min(seq_len, cfg.window)
        retrieve = flops.linear(d, memory.n_heads * memory.head_dim) + 2 * memory.n_heads * memory.head_dim * \
            memory.conv_kernel + flops.memory_mlp(memory) + flops.linear(memory.n_heads * memory.head_dim, d)
        retrieve += flops.linear(d, memory.n_heads) if memory.output_gate else 0
        block += retrieve + 6 * flops.linear(d, d) + flops.attention_span(d, cfg.n_persistent + 2 * segment)
    elif cfg.variant in ("mag", "mal"):
        block += 4 * flops.linear(d, d) + flops.attention_span(d, cfg.n_persistent + min(seq_len, cfg.window))
    if cfg.variant in ("mac", "mag") and cfg.gate == "convex":
        block += flops.linear(d, d)
    return flops.TRAIN * (cfg.n_layers * block + flops.linear(d, cfg.vocab_size))


# The parts of a block compiled each on its own when compile is on (`compile_regions`).
COMPILED_REGIONS = ("attention", "gate", "feed_forward")  # torch's own modules (the norms) cannot be compiled alone


def compiled_modules(model) -> list[str]:
    """The submodules `compile_regions` compiles: a whole-sequence block whole, else its
    `COMPILED_REGIONS`."""
    names = []
    for key, block in model.layers.named_children():
        if block.memory.cfg.whole_sequence:
            names.append(f"layers.{key}")
        else:
            names += [f"layers.{key}.{name}" for name in COMPILED_REGIONS if getattr(block, name, None) is not None]
    return names


def compile_regions(model, backend: str) -> None:
    """Regional torch.compile of a Titans LM, in place of torchtitan's per-block compile.

    torchtitan compiles each block whole with `fullgraph=True`, which unrolls the memory's
    chunk loop into the block's graph: compile time grows with T / chunk (one MAC block at
    the paper's chunk 64 and T 4096 spends 107 s tracing before any code generation, and
    Inductor took 377 s at T 1024 on a CPU: `scripts/bench_compile.py`, docs/benchmarks.md).
    Here each block's attention, gate and SwiGLU are compiled on their own
    (`fullgraph=True`), and the memory runs its chunk loop eagerly with every chunk step
    compiled (`NeuralMemoryConfig.compiled_chunk_step`: one graph per shape, two with a
    non-learned initial state), so compile time does not depend on T. The memory's
    projections, conv and gates stay eager.

    A block whose memory runs on the whole-sequence kernels (`NeuralMemoryConfig.whole_sequence`)
    is compiled whole instead (`fullgraph=True`, as torchtitan would): the kernels are custom ops
    the graph keeps opaque, so no chunk loop unrolls, and the memory's projections, gates and
    read fuse with the rest (tracing MAG's block on the meta device: constant in T; MAC's still
    grows with its segments, docs/benchmarks.md)."""
    for block in model.layers.values():
        if not block.memory.cfg.whole_sequence:
            block.memory.cfg = dataclasses.replace(block.memory.cfg, compiled_chunk_step=True)
    for name in compiled_modules(model):
        model.get_submodule(name).compile(backend=backend, fullgraph=True)


def parallelize_titans(model, *, parallel_dims, training, parallelism, compile_config, ac_config, dump_folder):
    """AC -> regional compile (`compile_regions`) -> FSDP2: torchtitan's helpers through
    `parallelize_plain_decoder`, its per-block compile turned off."""
    from torchtitan_ext.families.plain_model import parallelize_plain_decoder

    if compile_config.enable:
        compile_regions(model, compile_config.backend)
        compile_config = dataclasses.replace(compile_config, enable=False)
    return parallelize_plain_decoder(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                     compile_config=compile_config, ac_config=ac_config, dump_folder=dump_folder)


def titans_spec(flavor: str, **overrides):
    """The family's ModelSpec: the plain-model spec with `parallelize_titans`."""
    from torchtitan_ext.families.plain_model import plain_model_spec, torchtitan_model

    config = FAMILY.config(flavor, **overrides)
    spec = plain_model_spec(FAMILY.spec_name(config), flavor,
                            torchtitan_model(TitansLM, TitansConfig, FAMILY.flops_per_token), config)
    return dataclasses.replace(spec, parallelize_fn=parallelize_titans)


FAMILY = Family(name="titans", summary="Titans: neural long-term memory as context (MAC), gate (MAG), layer (MAL), "
                "or alone (LMM) (arXiv:2501.00663)", flavors=FLAVORS, config_class=TitansConfig, plain_class=TitansLM,
                variant_field="variant", variants=VARIANTS, flops_per_token=flops_per_token,
                diagnostics=memory_diagnostics, build_spec=titans_spec, compile_regions=compile_regions,
                compiled_modules=compiled_modules)
model_config, model_spec = FAMILY.config, FAMILY.model_spec
