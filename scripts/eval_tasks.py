"""Synthetic memory tasks, generated here (no download), scored per task, against context length;
BABILong (`--tasks babilong`); GradMem's KV-retrieval from the memory alone (`--mode gradmem`).
The protocol is torchtitan_ext/eval/tasks.py's docstring, printed after the options below.

    python scripts/eval_tasks.py --checkpoint <dump>/checkpoint/step-N --config train_configs.mela:mela_debug \\
        [--checkpoint ... --config ... --mode ...] --tasks kv_retrieval,s_niah,mk_niah,fwe \\
        --context-lengths 1024,2048 --samples 20 --out <dir>

Writes results.json, results.md and tasks_vs_context.png (babilong.* with --tasks babilong,
gradmem.* with --mode gradmem) to --out, staged and moved into place at the end; bad input:
one line, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchtitan_ext.errors import UserError
from torchtitan_ext.eval import babilong, tasks
from torchtitan_ext.paths import write_results
from torchtitan_ext.data.synthetic_tasks import HAYSTACKS, TASKS
from torchtitan_ext.data.task_data import QUESTIONS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, epilog=tasks.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", action="append", required=True)
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--mode", action="append", choices=("full", "streaming", "gradmem"))
    parser.add_argument("--pairs", default="4,8,16,32,64,96", help="gradmem mode: key-value pairs per context")
    parser.add_argument("--write-steps", default="1,2,5", help="gradmem mode: K at evaluation (gradient WRITE)")
    parser.add_argument("--label", action="append")
    parser.add_argument("--question", action="append", choices=QUESTIONS,
                        help="new_segment (default for MoNe) or continue (default otherwise); one, or one per checkpoint")
    parser.add_argument("--haystack", choices=HAYSTACKS, help="needle tasks' haystack (default: the paper's per task)")
    parser.add_argument("--tasks", default=",".join(TASKS), help="or babilong alone (its own table)")
    parser.add_argument("--context-lengths", default="1024,2048,4096", help="babilong: also 0k,1k,2k,...")
    parser.add_argument("--babilong-path", help="babilong: a folder of the official files (default: generated qa1-qa5)")
    parser.add_argument("--babilong-tasks", help="babilong: e.g. qa1,qa2 (default: qa1-qa10 of the files, qa1-qa5 generated)")
    parser.add_argument("--samples", type=int, help="per task and length (default 20; babilong 100)")
    parser.add_argument("--answer-tokens", type=int, help="greedy tokens (default 12; babilong 25)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.tasks != "babilong":
            args.samples, args.answer_tokens = args.samples or 20, args.answer_tokens or 12
        if args.mode and "gradmem" in args.mode:
            results = tasks.run_gradmem(args)
            write_results(args.out, results, tasks.gradmem_markdown(results),
                          {"gradmem.png": lambda path: tasks.gradmem_plot(results, path)}, stem="gradmem")
            return
        if args.tasks == "babilong":
            results = tasks.run_babilong(args)
            write_results(args.out, results, babilong.markdown(results),
                          {"babilong.png": lambda path: babilong.plot(results, path)}, stem="babilong")
            return
        results = tasks.run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    write_results(args.out, results, tasks.markdown(results),
                  {"tasks_vs_context.png": lambda path: tasks.plot(results, path)})


if __name__ == "__main__":
    main()
