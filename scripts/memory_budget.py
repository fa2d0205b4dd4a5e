"""Predict the peak accelerator memory of a training config, broken down (no GPU, no memory used).

    python scripts/memory_budget.py --config titans_mac_400m --local-batch 8 --seq-len 4096 \\
        [--checkpoint-chunks [N]] [--dtype bf16|fp32] [--fsdp-ranks R] [--device-gib 80] [--measure]

Parameters, gradients and AdamW states (fp32, sharded over R FSDP ranks), buffers, activations
(simulated on the meta device, with the memory's checkpoint_chunks off and on and the config's
activation checkpointing) and the memories' fast-weight state; method and what is left out:
torchtitan_ext/training/memory_budget.py. `--checkpoint-chunks` alone recomputes groups of the
config's size (4 where it has none), `--checkpoint-chunks 0` turns it off; defaults: the
config's batch, sequence length, dtype and recompute. `--measure` also runs one real step on
this machine's CPU and prints its measured peak (debug configs only: the whole model is
allocated).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from torchtitan_ext.families import family_of_config_function
from torchtitan_ext.training import memory_budget as mb

SAME_AS_CONFIG = -1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a train_configs function, e.g. titans_mac_400m")
    parser.add_argument("--local-batch", type=int, default=None, help="sequences per rank (default: the config's)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the config's)")
    parser.add_argument("--checkpoint-chunks", type=int, nargs="?", const=SAME_AS_CONFIG, default=None,
                        help="recompute the memory in groups of N chunks (alone: the config's or 4; 0: off)")
    parser.add_argument("--dtype", choices=sorted(mb.DTYPES), default=None, help="compute dtype (default: the config's)")
    parser.add_argument("--fsdp-ranks", type=int, default=1, help="ranks FSDP shards parameters, gradients, states over")
    parser.add_argument("--device-gib", type=float, default=None, help="the device's memory: say whether it fits")
    parser.add_argument("--max-sim-tokens", type=int, default=mb.DEFAULT_SIM_TOKENS,
                        help="longest sequence simulated directly (longer: two lengths, extrapolated)")
    parser.add_argument("--measure", action="store_true", help="also measure one real step on the CPU (debug sizes)")
    args = parser.parse_args(argv)

    try:
        family = family_of_config_function(args.config)
    except ValueError as e:
        sys.exit(f"error: {e}")
    job = getattr(importlib.import_module(family.config_module), args.config)()
    groups = args.checkpoint_chunks
    if groups == SAME_AS_CONFIG:
        groups = mb.configured_groups(job) or mb.DEFAULT_GROUPS
    budget = mb.budget_of_job(job, local_batch=args.local_batch, seq_len=args.seq_len, dtype=args.dtype,
                              ranks=args.fsdp_ranks, checkpoint_chunks=groups, max_sim_tokens=args.max_sim_tokens)
    print(f"{args.config}: " + "\n".join(budget.lines()))
    if args.device_gib:
        device = args.device_gib * mb.GiB
        print(mb.warning_line(job, device, budget=budget) or f"fits: {budget.peak / mb.GiB:.2f} of {args.device_gib:.1f} GiB")
    if args.measure:
        model = mb.job_model(job, groups, device="cpu")
        measured = mb.measured_cpu_peak(model, budget.batch, budget.seq_len, getattr(job.loss, "num_chunks", 1),
                                        extra=mb.attention_metadata(job))
        print(f"measured on CPU (fp32 step, allocator events): {measured / mb.GiB:.3f} GiB; "
              f"predicted / measured {budget.peak / measured:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
