"""Does a learned prefix vector slow MQAR learning? One MQAR suite row trained at several seeds,
with or without one learned vector before every sequence (torchtitan_ext/eval/mqar_prefix.py;
the study behind docs/benchmarks.md "The learned prefix, tested").

    python scripts/mqar_prefix.py --row transformer_full --seeds 0-7 --prefix-std 0.02 --out runs.jsonl
    python scripts/mqar_prefix.py --row mela_memory_off --seeds 0,1 --steps 5400 \\
        --set patch_size=8 --set chunk_size=4 --out runs.jsonl

Each run trains as the suite does (its full setting; `--steps` overrides the step count,
`--quick` takes the seconds-long setting the tests use) and appends one JSON line to `--out`:
the validation curve, the last validation accuracy and whether it reached 0.8 ("solved"). A
run already in `--out` is not repeated. Prints one line a run, then the solved count.
`--summary` runs nothing: it prints every run in `--out` as a markdown table, each prefixed
setting beside the same row without a prefix (solved counts, one-sided Fisher exact p).
`--set FIELD=VALUE` overrides a config field of the row (VALUE read as JSON, else a string);
`--setting FIELD=VALUE` a field of the suite setting (e.g. window=16 mela_patch=8 mela_chunk=2:
Mela's decoder chunks of 16 tokens, and the within / beyond split at 16). `--loss-reach N`
asks the loss only the queries whose key lies at most N tokens back (e.g. the window-only
control trained on what its window reaches); with `--loss-reach-steps S` only on the first S
steps, every query after them (a curriculum).
Bad input (no or an unknown --row, a malformed --seeds, a field --set or --setting cannot take,
--summary of a missing file) prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torchtitan_ext.errors import UserError
from torchtitan_ext.eval import mqar_prefix, mqar_suite
from torchtitan_ext.eval.jsonl import read_records


def parse_seeds(text: str) -> list[int]:
    """"0-7" or "0,3,5" -> seeds."""
    try:
        if "-" in text:
            first, last = (int(part) for part in text.split("-"))
            return list(range(first, last + 1))
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--seeds '{text}' is neither a range like 0-7 nor a list like 0,3,5") from None


def parse_overrides(items: list[str]) -> dict:
    overrides = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UserError(f"'{item}' needs the form FIELD=VALUE, e.g. --set patch_size=8")
        try:
            overrides[name] = json.loads(value)
        except json.JSONDecodeError:
            overrides[name] = value
    return overrides


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", help=", ".join(mqar_suite.ROWS))
    parser.add_argument("--seeds", default="0-7", help="a range (0-7) or a list (0,3,5)")
    parser.add_argument("--prefix-std", type=float, help="std of the learned prefix vector (omit: no prefix)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a config field of the row")
    parser.add_argument("--setting", action="append", default=[], metavar="FIELD=VALUE", help="a field of the suite setting")
    parser.add_argument("--loss-reach", type=int, default=0,
                        help="ask the loss only queries whose key lies at most N tokens back (0: every query)")
    parser.add_argument("--loss-reach-steps", type=int, default=0,
                        help="apply --loss-reach on the first S steps only (0: on every step)")
    parser.add_argument("--quick", action="store_true", help="the tiny setting the tests run")
    parser.add_argument("--out", type=Path, required=True, help="JSON-lines file the runs are appended to")
    parser.add_argument("--summary", action="store_true", help="print the runs in --out as a table; run nothing")
    args = parser.parse_args(argv)
    try:
        if args.summary:
            print(mqar_prefix.summary(read_records(args.out, "seeds")))
            return
        if args.row not in mqar_suite.ROWS:
            raise UserError(f"{'unknown row ' + repr(args.row) if args.row else '--row is needed'}: "
                            f"choose from {', '.join(mqar_suite.ROWS)}")
        seeds, overrides = parse_seeds(args.seeds), parse_overrides(args.set)
        changes = parse_overrides(args.setting)
        if args.steps is not None:
            changes["steps"] = args.steps
        setting = mqar_prefix.setting_with(args.quick, **changes)
        mqar_prefix.check_overrides(args.row, setting, overrides)
        if args.loss_reach < 0 or args.loss_reach_steps < 0:
            raise UserError(f"--loss-reach {args.loss_reach} --loss-reach-steps {args.loss_reach_steps}: give counts "
                            ">= 1, or 0 (every query; every step)")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    records = mqar_prefix.run_all(args.row, setting, seeds, args.lr, args.prefix_std, overrides, args.out,
                                  log=lambda line: print(line, flush=True), loss_reach=args.loss_reach,
                                  loss_reach_steps=args.loss_reach_steps)
    print(f"solved (validation >= {mqar_prefix.SOLVED}): {sum(r['solved'] for r in records)} of {len(records)} seeds")


if __name__ == "__main__":
    main()
