"""Long-context perplexity: NLL per token against context length, for one or more checkpoints.
The protocol (documents, modes, datasets, checkpoints, whole-book test-time training) is
torchtitan_ext/eval/long_ppl.py's docstring, printed after the options below.

    python scripts/eval_long_ppl.py --checkpoint <dump>/checkpoint/step-N --config train_configs.mela:mela_debug \\
        [--checkpoint ... --config ...] --context-lengths 1024,2048,4096 --dataset embedded --out <dir> \\
        [--mode full|streaming|truncated|sliding ...] [--label NAME ...] [--max-docs 16] [--bucket 512]

    python scripts/eval_long_ppl.py --checkpoint <hf folder> --config train_configs.backbone:backbone_qwen3_debug \\
        --ttt truncated,templora,locas_glu,locas_glu:random_select --window 256 --dataset <book.txt> --split all --out <dir>

Writes results.json, results.md and perplexity_vs_context.png (with --ttt: cumulative_ppl.png)
to --out, through a temporary folder moved into place at the end (nothing half-written on
failure). Bad input (a checkpoint of another family or size, a missing tokenizer, a context
the model cannot take in the chosen mode, no document long enough) ends with one line and
exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from models.memory.locas import MLP_GRADIENTS
from torchtitan_ext.errors import UserError
from torchtitan_ext.eval import long_ppl, whole_book
from torchtitan_ext.paths import write_results

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, epilog=long_ppl.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", action="append", required=True, help="DCP step folder (repeat for several)")
    parser.add_argument("--config", action="append", required=True, help="<module>:<function> it was trained with")
    parser.add_argument("--mode", action="append", choices=long_ppl.MODES)
    parser.add_argument("--label", action="append")
    parser.add_argument("--context-lengths", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--dataset", default="embedded")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-docs", type=int, default=16)
    parser.add_argument("--bucket", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--window", type=int, help="truncated/sliding span (default: the training seq_len); "
                        "streaming a backbone or graft: its attention's span (default: every earlier token)")
    parser.add_argument("--segment", type=int, help="streaming segment (default: the model's stream unit, at least 64 tokens)")
    parser.add_argument("--split", choices=("heldout", "all"), default="heldout",
                        help="local datasets: the held-out split training never reads, or every document")
    ttt = parser.add_argument_group("whole-book test-time training (--ttt; torchtitan_ext/eval/whole_book.py)")
    ttt.add_argument("--ttt", help="comma-separated methods: truncated, full, templora, locas_glu[:init], locas_mlp[:bp|nlsvd]")
    ttt.add_argument("--chunk", type=int, help="tokens scored (then learned from) per step (default: half the window)")
    ttt.add_argument("--full-window", type=int, help="the full method's span (default: the model's max_seq_len)")
    ttt.add_argument("--ttt-rank", type=int, default=64, help="Locas width r / TempLoRA rank")
    ttt.add_argument("--ttt-lr", type=float, default=4e-3, help="Locas' AdamW lr (the paper's 4e-3)")
    ttt.add_argument("--templora-lr", type=float, default=1e-3)
    ttt.add_argument("--ttt-steps", type=int, default=1, help="updates per chunk")
    ttt.add_argument("--locas-layers", default="all", help="blocks with a Locas memory (all, alma, elma, gema:k, 0,3,...)")
    ttt.add_argument("--value-scale", type=float, default=1.0, help="Locas-MLP's value init scale eps")
    ttt.add_argument("--locas-gradient", choices=MLP_GRADIENTS, default="chunk",
                     help="Locas-MLP's G_t: of the chunk's log-likelihood, or of log p(x_t | x_<t) per token (A.1.6)")
    ttt.add_argument("--seeds", default="0", help="comma-separated seeds: the methods that draw at random (templora, "
                     "locas_glu:random_select|gaussian) read every document once per seed; intervals resample seeds, "
                     "then documents")
    ttt.add_argument("--min-doc-tokens", type=int, default=0, help="skip documents shorter than this")
    ttt.add_argument("--max-doc-tokens", type=int, help="read only each document's first N tokens")
    ttt.add_argument("--probe-dataset", default="embedded", help="held-out text of the forgetting probe")
    ttt.add_argument("--probe-docs", type=int, default=8, help="probe documents (0: no probe)")
    ttt.add_argument("--merge-out", type=Path, help="write the first Locas method's model after the last document, "
                     "its memory merged into the FFNs, as a Hugging Face folder here")
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16" if cuda else "float32")
    args = parser.parse_args(argv)
    args.dtype = DTYPES[args.dtype]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        results = long_ppl.run_ttt(args) if args.ttt else long_ppl.run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.ttt:
        write_results(args.out, results, whole_book.markdown(results),
                      {"cumulative_ppl.png": lambda path: whole_book.plot(results, path)})
        return
    write_results(args.out, results, long_ppl.markdown(results),
                  {"perplexity_vs_context.png": lambda path: long_ppl.plot(results, path)})


if __name__ == "__main__":
    main()
