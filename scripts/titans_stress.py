"""Does the Titans memory train finite at its defaults wherever a user trains it? The stress
sweep of issue 46 (torchtitan_ext/eval/titans_stress.py; the table in docs/benchmarks.md
"Titans memory finite by default").

    python scripts/titans_stress.py --out docs/titans_stress/runs.jsonl            # the 216-cell grid
    python scripts/titans_stress.py --out runs.jsonl --memory max_update_norm=0 --lrs 1e-2   # the unbounded memory
    python scripts/titans_stress.py --out docs/titans_stress/runs.jsonl --summary
    python scripts/titans_stress.py --out runs.jsonl --variants mag --widths 64 --lrs 3e-3 --seq-lens 128 \
        --chunks 16 --steps 3000 --batch-size 32 --cosine-steps 3000    # issue 46's reported run

Each cell (variant x width x lr x T x memory chunk, one seed of 0-4) trains on MQAR for
`--steps` steps and appends one JSON line to `--out`; cells already there are skipped, so an
interrupted sweep resumes. Prints one line a cell, then the summary table. `--summary` runs
nothing and prints the table of `--out`. `--quick` runs 2 cells of 3 steps (what the tests
run). Bad input (an unknown variant, a malformed list or --memory, --summary of a missing
file) prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchtitan_ext.errors import UserError
from torchtitan_ext.eval import titans_stress
from torchtitan_ext.eval.jsonl import read_records


def numbers(text: str, kind=float) -> tuple:
    try:
        return tuple(kind(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"'{text}' is not a comma-separated list of numbers, e.g. 1e-3,3e-3") from None


def memory_overrides(items: list[str]) -> dict:
    from models.memory.neural_memory import NeuralMemoryConfig

    fields = {f.name for f in NeuralMemoryConfig.__dataclass_fields__.values()}
    overrides = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise UserError(f"--memory '{item}' needs the form FIELD=NUMBER with a NeuralMemoryConfig field, "
                            "e.g. max_update_norm=0")
        overrides[name] = numbers(value)[0]
    return overrides


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON-lines file the cells are appended to")
    parser.add_argument("--variants", default=",".join(titans_stress.VARIANTS))
    parser.add_argument("--widths", default=",".join(map(str, titans_stress.WIDTHS)))
    parser.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in titans_stress.LRS))
    parser.add_argument("--seq-lens", default=",".join(map(str, titans_stress.SEQ_LENS)))
    parser.add_argument("--chunks", default=",".join(map(str, titans_stress.CHUNKS)))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--cosine-steps", type=int, default=0,
                        help="0: the peak lr held after a 10%% warmup; N: 5%% warmup of N, then a cosine to 0 over N")
    parser.add_argument("--memory", action="append", default=[], metavar="FIELD=NUMBER",
                        help="a memory config field for every cell (e.g. max_update_norm=0: no bound)")
    parser.add_argument("--quick", action="store_true", help="2 cells of 3 steps (the tests)")
    parser.add_argument("--summary", action="store_true", help="print the table of --out; run nothing")
    args = parser.parse_args(argv)
    try:
        if args.summary:
            print(titans_stress.summary(read_records(args.out, "cells")))
            return
        variants = tuple(args.variants.split(","))
        unknown = [v for v in variants if v not in titans_stress.VARIANTS]
        if unknown:
            raise UserError(f"unknown variant {unknown[0]!r}: choose from {', '.join(titans_stress.VARIANTS)}")
        levels = dict(variants=variants, widths=numbers(args.widths, int), lrs=numbers(args.lrs),
                      seq_lens=numbers(args.seq_lens, int), chunks=numbers(args.chunks, int))
        if args.quick:
            levels = dict(variants=("lmm", "mac"), widths=(16,), lrs=(1e-2,), seq_lens=(32,), chunks=(8,))
        cells = titans_stress.grid(3 if args.quick else args.steps, 2 if args.quick else args.batch_size,
                                   memory_overrides(args.memory), cosine_steps=args.cosine_steps, **levels)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    titans_stress.run(cells, args.out, log=lambda line: print(line, flush=True))
    print(titans_stress.summary(read_records(args.out)))


if __name__ == "__main__":
    main()
