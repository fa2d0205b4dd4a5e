"""scripts/bench_mone.py: MoNe's query cost and state stay constant as the context grows,
in-context reading's grow (the paper's efficiency claim, fig. 2), at a tiny width."""

from __future__ import annotations

import torch

from conftest import load_script
from models.backbones.decoder_lm import DecoderLM, DecoderLMConfig
from models.grafts.graft import GraftConfig

bench_mone = load_script("bench_mone")

SEGMENT = 16


def test_the_query_reads_a_constant_state_under_mone_and_a_growing_cache_without():
    shape = dict(architecture="qwen3", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                 ffn_hidden=64, qk_norm=True)
    torch.manual_seed(0)
    icl = DecoderLM(DecoderLMConfig(**shape))
    mone = DecoderLM(DecoderLMConfig(**shape, graft=GraftConfig(kind="mone", memory={"segment": SEGMENT})))
    runs = {}
    for n in (4 * SEGMENT, 8 * SEGMENT):
        tokens = torch.randint(0, 64, (1, n + bench_mone.QUERY))
        runs[n] = (bench_mone.read(icl, tokens, SEGMENT), bench_mone.read(mone, tokens, SEGMENT))
    (icl_short, mone_short), (icl_long, mone_long) = runs[4 * SEGMENT], runs[8 * SEGMENT]
    assert mone_long["state"] == mone_short["state"] and mone_long["query_flops"] == mone_short["query_flops"]
    assert icl_long["state"] > 1.5 * icl_short["state"] and icl_long["query_flops"] > icl_short["query_flops"]
    def context(run):
        return run["total_flops"] - run["query_flops"]

    assert context(mone_long) == 2 * context(mone_short)  # reading the context: linear (every segment costs the same)
    assert context(icl_long) > 2.2 * context(icl_short)  # in-context reading: superlinear (attention)
