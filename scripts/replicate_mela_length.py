"""Small-scale replication of Mela's length claim (002_*.txt, Figure 4) on CPU.

mela_debug and a Transformer++ of the same size (transformer_small, 2.4M parameters each)
train on the same data, steps and context (512 tokens), then perplexity is measured at 1x,
2x, 4x and 8x the training context (Mela streams chunk by chunk; the Transformer reads the
whole context in one pass). The paper's claim: Mela stays on the same order while the
Transformer degrades sharply past its training length.

Data: the embedded CPython corpus. Every other document of at least 8x the context in
tokens is held out for evaluation; the rest is the training set (local jsonl files).

    python scripts/replicate_mela_length.py --out outputs/replication [--steps 400]
Writes <out>/eval/{results.json,results.md,perplexity_vs_context.png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODELS = {"mela_debug": "train_configs.mela", "transformer_small": "train_configs.transformer"}


def split_corpus(folder: Path, min_tokens: int) -> None:
    """train.jsonl / eval.jsonl: every other document with >= min_tokens tokens is held out."""
    from torchtitan_ext.embedded_corpus import embedded_documents
    from torchtitan_ext.paths import default_tokenizer_dir
    from torchtitan_ext.tokenizer import AssetsTokenizer

    tokenizer = AssetsTokenizer(AssetsTokenizer.Config(), tokenizer_path=str(default_tokenizer_dir()))
    long_docs = 0
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.jsonl", "w") as train, open(folder / "eval.jsonl", "w") as held_out:
        for doc in embedded_documents():
            is_long = len(tokenizer.encode(doc)) >= min_tokens
            long_docs += is_long
            target = held_out if is_long and long_docs % 2 else train
            target.write(json.dumps({"text": doc}) + "\n")


def train(name: str, folder: Path, data: Path, seq_len: int, steps: int) -> Path:
    final = folder / name / "checkpoint" / f"step-{steps}"
    if final.exists():
        return final
    args = ["--module", MODELS[name], "--config", name, "--dump_folder", str(folder / name),
            "--training.seq_len", str(seq_len), "--training.steps", str(steps),
            "--lr_scheduler.warmup_steps", str(steps // 10), "--checkpoint.interval", str(steps),
            "--validator.no-enable", "--dataloader.dataset", "local",
            "--dataloader.dataset_path", str(data / "train.jsonl"), "--debug.seed", "0"]
    subprocess.run(["bash", str(REPO / "scripts" / "train.sh"), *args], check=True, cwd=REPO,
                   env={**os.environ, "SKIP_SETUP": "1"})
    return final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/replication"))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    out = args.out.resolve()
    lengths = [args.seq_len * k for k in (1, 2, 4, 8)]
    split_corpus(out / "data", lengths[-1])
    checkpoints = {name: train(name, out, out / "data", args.seq_len, args.steps) for name in MODELS}
    command = [sys.executable, str(REPO / "scripts" / "eval_long_ppl.py"), "--out", str(out / "eval"),
               "--dataset", str(out / "data" / "eval.jsonl"), "--context-lengths", ",".join(map(str, lengths)),
               "--bucket", str(args.seq_len)]
    for name, step_dir in checkpoints.items():
        mode = "streaming" if name.startswith("mela") else "full"
        command += ["--checkpoint", str(step_dir), "--config", f"{MODELS[name]}:{name}", "--mode", mode]
    subprocess.run(command, check=True, cwd=REPO)


if __name__ == "__main__":
    main()
