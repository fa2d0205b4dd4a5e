"""Benchmark: MoNe against in-context reading (ICL) as the context grows (MoNe paper, fig. 2).

The debug Qwen3 (random weights; cost does not depend on them), one row, no gradients, fp32
on this machine. For each context length N: ICL is the backbone reading the context into
its key / value cache, then a 32-token query attending to all of it; MoNe is the same
backbone with MoNe in every block (segments of `--segment` tokens) reading the context
segment by segment (test-time learning), then the query, a fresh segment, attending to
itself and its memory tokens. Both through `DecoderLM.stream`. Reported per N: matmul FLOPs
of the query and of the whole (torch's FlopCounterMode), the bytes of the state the query
reads (ICL: the key / value cache; MoNe: fast weights, momenta and the segment cache),
seconds, MoNe / ICL ratios, and the achieved FLOP/s of MoNe's context read against this
machine's fp32 matmul FLOP/s measured now.

    python scripts/bench_mone.py [--lengths 1024,4096,16384] [--segment 64]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from models.backbones.decoder_lm import DecoderLM
from models.grafts.graft import GraftConfig
from torchtitan_ext.families.backbone import FAMILY
from torchtitan_ext.training.cpu import measured_matmul_flops
from torchtitan_ext.flops import CPU_ATTENTION_FLOPS

QUERY = 32


def state_bytes(state) -> int:
    """Bytes of every tensor a stream's state holds."""
    def walk(value):
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, (tuple, list)):
            return sum(walk(v) for v in value)
        return 0

    return walk(state.caches)


def counted(fn):
    """(result, matmul and attention FLOPs, seconds of a second, uncounted call) of fn()."""
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        fn()
    start = time.perf_counter()
    result = fn()
    return result, counter.get_total_flops(), time.perf_counter() - start


def read(model: DecoderLM, tokens: torch.Tensor, segment: int) -> dict:
    """Read the context in segments, then the query: FLOPs, seconds, the state's bytes."""
    context, query = tokens[:, :-QUERY], tokens[:, -QUERY:]

    def read_context():
        state = None
        for start in range(0, context.shape[1], segment):
            _, state = model.stream(context[:, start:start + segment], state)
        return state

    with torch.no_grad():
        state, context_flops, context_seconds = counted(read_context)
        _, query_flops, query_seconds = counted(lambda: model.stream(query, state))
    return {"query_flops": query_flops, "total_flops": context_flops + query_flops, "state": state_bytes(state),
            "seconds": context_seconds + query_seconds, "context_flops_per_s": context_flops / context_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--segment", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    icl = DecoderLM(FAMILY.config("qwen3_debug")).eval()
    mone = DecoderLM(FAMILY.config("qwen3_debug", graft=GraftConfig(
        kind="mone", layers="all", memory={"segment": args.segment}))).eval()
    peak = measured_matmul_flops()
    print(f"debug Qwen3 (dim 128, 4 blocks), MoNe segments of {args.segment}, query {QUERY} tokens; "
          f"fp32 matmul peak here {peak / 1e9:.1f} GFLOP/s")
    print(f"{'N':>6} | {'query GFLOP ICL / MoNe (ratio)':>32} | {'total GFLOP ICL / MoNe (ratio)':>32} | "
          f"{'state MiB ICL / MoNe':>20} | {'seconds ICL / MoNe':>18} | MoNe read / peak")
    warm_up = torch.randint(0, icl.cfg.vocab_size, (1, 2 * args.segment + QUERY))
    read(mone, warm_up, args.segment), read(icl, warm_up, args.segment)
    for n in (int(x) for x in args.lengths.split(",")):
        tokens = torch.randint(0, icl.cfg.vocab_size, (1, n + QUERY))
        ours, theirs = read(mone, tokens, args.segment), read(icl, tokens, args.segment)
        print(f"{n:>6} | {theirs['query_flops'] / 1e9:>9.3f} / {ours['query_flops'] / 1e9:.3f} "
              f"({ours['query_flops'] / theirs['query_flops']:.2f}) | {theirs['total_flops'] / 1e9:>9.2f} / "
              f"{ours['total_flops'] / 1e9:.2f} ({ours['total_flops'] / theirs['total_flops']:.2f}) | "
              f"{theirs['state'] / 2**20:>8.2f} / {ours['state'] / 2**20:.2f} | "
              f"{theirs['seconds']:>7.2f} / {ours['seconds']:.2f} | {ours['context_flops_per_s'] / peak:.2f}")


if __name__ == "__main__":
    main()
