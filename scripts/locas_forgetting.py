"""Forgetting after test-time memorisation, as the Locas paper's Table 4 measures it (paper 000,
section 3.3.3): a multiple-choice benchmark (MMLU's test split in the paper) scored by
EleutherAI's lm-evaluation-harness on the model before memorising a book and on the model
after it, its Locas memory merged into the FFNs (`eval_long_ppl.py --ttt locas_glu --merge-out`,
a plain Qwen3ForCausalLM / LlamaForCausalLM folder).

    # the paper's check (downloads MMLU from the Hub):
    python scripts/locas_forgetting.py --model baseline=<Qwen3-1.7B-Base folder> \\
        --model locas_glu=hf/qwen3_1_7b_locas --tasks mmlu --out eval/locas_mmlu
    # offline, on a local lm-eval task (a YAML folder of your own):
    python scripts/locas_forgetting.py --model baseline=<folder> --model locas_glu=<merged folder> \\
        --tasks my_task --include-path <task folder> --out eval/locas_forgetting

Every `--model LABEL=FOLDER` (the first is the baseline) is run through lm_eval's "hf" model
(`torchtitan_ext/eval/zero_shot.py`) with its samples logged (float32 on CPU, `--device` / `--dtype` otherwise); the
per-question `acc` of every task (MMLU's 57 subjects pooled, each question weighing the same)
gives each model's accuracy with a 95% bootstrap interval over questions, and its change from
the baseline paired by question (the same questions, `torchtitan_ext/eval/stats.py`).
Writes results.json and results.md (Table 4's columns: accuracy, change from baseline) to
--out. Bad input (lm_eval missing, a folder that is not a Hugging Face model, lm_eval
failing) ends with one line and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from torchtitan_ext.errors import UserError
from torchtitan_ext.eval.stats import bootstrap
from torchtitan_ext.eval.zero_shot import run_lm_eval
from torchtitan_ext.paths import write_results


def parse_models(specs: list[str]) -> list[tuple[str, Path]]:
    """['label=folder', ...] -> [(label, folder)]; UserError on a spec without '=' or a folder
    without config.json."""
    models = []
    for spec in specs:
        label, sep, folder = spec.partition("=")
        if not sep or not label or not folder:
            raise UserError(f"--model '{spec}' must be LABEL=FOLDER, e.g. baseline=hf/qwen3_1_7b")
        if not (Path(folder) / "config.json").is_file():
            raise UserError(f"--model {label}: '{folder}' is not a Hugging Face model folder (no config.json): "
                            "give an export, e.g. eval_long_ppl.py --merge-out's folder")
        models.append((label, Path(folder)))
    return models


def compare(per_model: dict[str, dict[tuple[str, int], float]]) -> list[dict]:
    """Accuracy per model over the questions every model answered, with a 95% bootstrap
    interval over questions, and its change from the first model paired by question."""
    labels = list(per_model)
    shared = sorted(set.intersection(*(set(s) for s in per_model.values())))
    baseline = torch.tensor([per_model[labels[0]][q] for q in shared], dtype=torch.float64)
    rows = []
    for label in labels:
        acc = torch.tensor([per_model[label][q] for q in shared], dtype=torch.float64)
        diff = acc - baseline
        rows.append({"model": label, "questions": len(shared), "acc": acc.mean().item(),
                     "acc_ci95": list(bootstrap(acc, statistic="mean")), "delta": diff.mean().item(),
                     "delta_ci95": list(bootstrap(diff, statistic="mean"))})
    return rows


def markdown(results: dict) -> str:
    lines = [f"Accuracy (%) on `{results['tasks']}` ({results['rows'][0]['questions']} questions; lm-eval, "
             "95% bootstrap interval over questions; change from the baseline paired by question).", "",
             "| model | accuracy | change from baseline |", "| --- | --- | --- |"]
    for r in results["rows"]:
        lines.append(f"| {r['model']} | {100 * r['acc']:.1f} ({100 * r['acc_ci95'][0]:.1f}-{100 * r['acc_ci95'][1]:.1f}) | "
                     f"{100 * r['delta']:+.1f} ({100 * r['delta_ci95'][0]:+.1f} to {100 * r['delta_ci95'][1]:+.1f}) |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, help="LABEL=FOLDER (repeat; the first is the baseline)")
    parser.add_argument("--tasks", default="mmlu", help="lm_eval tasks (default: mmlu, the paper's Table 4)")
    parser.add_argument("--include-path", help="a folder of local lm_eval task YAMLs")
    parser.add_argument("--limit", type=int, help="questions per task (lm_eval --limit)")
    parser.add_argument("--out", type=Path, required=True)
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import importlib.util

        if importlib.util.find_spec("lm_eval") is None:
            raise UserError("lm_eval is not installed: EXTRAS=eval bash scripts/setup.sh")
        models = parse_models(args.model)
        per_model = {label: run_lm_eval(folder, args.tasks, args.include_path, args.device, args.dtype, args.limit)
                     for label, folder in models}
        results = {"tasks": args.tasks, "models": {label: str(folder) for label, folder in models},
                   "rows": compare(per_model)}
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    write_results(args.out, results, markdown(results))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
