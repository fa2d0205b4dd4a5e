"""Does memory X beat baseline Y at equal cost? Every family and graft trained and evaluated
the same way, one table (torchtitan_ext/eval/leaderboard*.py).

    python scripts/leaderboard.py --suite ci --out DIR [--rows mela,titans_mac]
    python scripts/leaderboard.py --suite cpu --out DIR --estimate     # cells and tokens, no run
    python scripts/leaderboard.py --suite paper --dry-run [--hf-assets-path FOLDER]
    python scripts/leaderboard.py --suite mqar --out DIR [--setting NAME | --quick] [--seeds N] [--steps N] [--rows a,b] [--jobs N]

`--suite mqar` (torchtitan_ext/eval/mqar_suite.py): every from-scratch family at one width and
depth on Zoology's MQAR, per task (key-value count x length) with intervals over seeds, a cost
column, the hypotheses answered per task; writes DIR/mqar.json (every prompt's per-query
outcome), DIR/mqar.md, DIR/mqar_accuracy.png, DIR/mqar_flops.png (accuracy against training
FLOPs), DIR/rows/<row>.json and DIR/runs/<row>/*.json (a rerun reuses finished rows and runs).
`--setting`: plateau32 (default: length 32, every run trained to its plateau), plateau128 (the
second shape: length 128, 8 pairs), full (the published 2026-11-26 run: 900 steps a run);
`--quick` is `--setting quick`, the seconds-long form the tests run; `--seeds N` / `--steps N`
override the setting's (the first seed sweeps the learning rates; rows the setting gives more
seeds, Setting.row_seeds, keep them; with a plateau, `--steps` is the base the cap multiplies).
`--rows` trains those rows; the report holds every row finished in DIR under the same setting
and lists the others as not run (batches of rows add up). `--jobs N` trains N runs at once, each in
a one-thread process (a many-core machine; each run trains as it would alone).

Writes DIR/leaderboard.md, DIR/leaderboard.json, DIR/ppl_vs_length.png,
DIR/recall_vs_length.png; each cell's figures in DIR/cells/<row>/seed<k>.json (a rerun skips
finished cells), its training run under DIR/runs/<row>/seed<k>/ (wandb offline), the
in-house backbone under DIR/backbone/. DIR/suite.json names the suite the folder holds.
`--dry-run` (the paper suite) runs the launcher's preflight for every row at 1x8, 4x8 and
16x8 ranks and prints the exact multi-node commands; `--hf-assets-path` stands a tokenizer in
for the paper configs' Llama-2 one (which cannot ship; README "A real run").
Bad input (an unknown suite or row, a folder holding another suite, the paper suite without
--dry-run or --estimate: it runs on a GPU cluster, not in this process) prints one line and
exits 2, writing nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torchtitan_ext.errors import UserError
from torchtitan_ext.eval import leaderboard, leaderboard_cells, leaderboard_launch, leaderboard_suites
from torchtitan_ext.paths import write_json


def check_out(out: Path, suite: str) -> None:
    """UserError when `out` holds another suite's results (its suite.json marker)."""
    marker = out / "suite.json"
    if marker.is_file() and json.loads(marker.read_text())["suite"] != suite:
        raise UserError(f"{out} holds suite '{json.loads(marker.read_text())['suite']}' results: pick another --out")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", required=True, help=", ".join([*leaderboard_suites.SUITES, "mqar"]))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rows", help="comma-separated row names (default: every row of the suite)")
    parser.add_argument("--dry-run", action="store_true", help="preflight and print the multi-node commands")
    parser.add_argument("--estimate", action="store_true", help="print the suite's cells and tokens, run nothing")
    parser.add_argument("--hf-assets-path", help="tokenizer folder standing in for the configs' own (--dry-run)")
    parser.add_argument("--quick", action="store_true", help="mqar: the tiny setting the tests run (--setting quick)")
    parser.add_argument("--setting", default="plateau32", help="mqar: plateau32, plateau128, full or quick")
    parser.add_argument("--seeds", type=int, help="mqar: number of training seeds")
    parser.add_argument("--steps", type=int, help="mqar: training steps per run")
    parser.add_argument("--jobs", type=int, default=1, help="mqar: runs trained at once, each in a one-thread "
                        "process (default 1: one after another in this process)")
    args = parser.parse_args(argv)
    if args.suite == "mqar":
        return run_mqar(args)
    try:
        chosen = leaderboard_suites.suite(args.suite)
        rows = leaderboard_suites.select_rows(chosen, args.rows)
        if args.dry_run:
            print(leaderboard_launch.dry_run(chosen, rows, args.hf_assets_path))
            return
        if args.estimate:
            print(leaderboard_launch.estimate(chosen, rows))
            return
        if chosen.name == "paper":  # run here it would train the debug rows in one process: refuse
            raise UserError("the paper suite trains its 400M rows on a GPU cluster, one multi-node launch per row: "
                            "pass --dry-run to preflight them and print those commands (or --estimate)")
        if args.out is None:
            raise UserError("--out DIR is needed to run a suite")
        out = args.out.resolve()  # torchtitan takes absolute checkpoint paths (the grafts' initial load)
        check_out(out, chosen.name)
        write_json(out / "suite.json", {"suite": chosen.name})
        counts = leaderboard_cells.run_cells(rows, chosen, out)
        leaderboard.report(out, chosen)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"cells run {counts['run']}, skipped {counts['skipped']}; wrote {args.out / 'leaderboard.md'}")


def run_mqar(args) -> None:
    import dataclasses

    from torchtitan_ext.eval import mqar_suite

    try:
        if args.out is None:
            raise UserError("--out DIR is needed to run a suite")
        if args.dry_run or args.estimate:
            raise UserError("--dry-run / --estimate are for the paper and cpu suites; the mqar suite runs here")
        name = "quick" if args.quick else args.setting
        if name not in mqar_suite.SETTINGS:
            raise UserError(f"unknown mqar setting '{name}': choose from {', '.join(mqar_suite.SETTINGS)}")
        setting = mqar_suite.SETTINGS[name]
        if args.seeds is not None:
            if args.seeds < 1:
                raise UserError("--seeds must be at least 1")
            setting = dataclasses.replace(setting, seeds=tuple(range(args.seeds)))
        if args.steps is not None:
            if args.steps < 1:
                raise UserError("--steps must be at least 1")
            setting = dataclasses.replace(setting, steps=args.steps)
        if args.jobs < 1:
            raise UserError(f"--jobs must be at least 1 (got {args.jobs})")
        rows = tuple(args.rows.split(",")) if args.rows else mqar_suite.ROWS
        unknown = [r for r in rows if r not in mqar_suite.ROWS]
        if unknown:
            raise UserError(f"unknown row(s) {unknown} in suite mqar: choose from {', '.join(mqar_suite.ROWS)}")
        out = args.out.resolve()
        check_out(out, "mqar")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    write_json(out / "suite.json", {"suite": "mqar"})
    mqar_suite.run_suite(setting, out, rows, log=print_flushed, jobs=args.jobs)
    print(f"wrote {args.out / 'mqar.md'} and {args.out / 'mqar.json'}")


def print_flushed(line: str) -> None:
    """The mqar suite's log (a module-level function: worker processes of `--jobs` take it by name)."""
    print(line, flush=True)


if __name__ == "__main__":
    main()
