#!/usr/bin/env bash
# The in-house pretrained backbone the grafts start from, offline on CPU:
#   1. train backbone_qwen3_pretrain (train_configs/backbone.py: qwen3_debug's 4-block Qwen3, native
#      window 256) on the embedded corpus' training split mixed with S-NIAH rows of 128-256 tokens,
#      inside the window, the loss on the whole row (torchtitan_ext/data/mixed_data.py);
#   2. export it as a Hugging Face Qwen3 folder (scripts/convert_to_hf.py): OUT_DIR/hf/;
#   3. score S-NIAH inside the window (scripts/eval_tasks.py: greedy answer after a prompt of
#      256 - 24 = 232 tokens, so prompt and answer stay inside the 256 positions trained on; the
#      sample counts when the needle's value is in the answer) with a 95% bootstrap interval
#      over samples: OUT_DIR/niah.json, and the training loss against step: OUT_DIR/loss.png.
#
#   bash scripts/pretrain_backbone.sh OUT_DIR [train.sh overrides...]
#
# Environment: STEPS [the config's PRETRAIN_STEPS], NIAH_SAMPLES [200], SKIP_SETUP=1. OUT_DIR is
# created, or reused when it holds an earlier run of this script (training resumes from its latest
# checkpoint); a missing OUT_DIR argument or a folder holding something else: one line, exit 2.
# Prints one summary line; logs in OUT_DIR/train.log and OUT_DIR/eval.log.
set -euo pipefail
if [ $# -lt 1 ] || [ -z "$1" ] || [ "${1#-}" != "$1" ]; then  # no OUT_DIR, or an override in its place
  echo "error: usage: bash scripts/pretrain_backbone.sh OUT_DIR [train.sh overrides...]" >&2
  exit 2
fi
out=$1
shift
marker=.pretrain_backbone  # written into OUT_DIR: the folder is this script's
if [ -e "$out" ] && { [ ! -d "$out" ] || { [ -n "$(ls -A "$out")" ] && [ ! -e "$out/$marker" ]; }; }; then
  echo "error: $out holds something else than a pretrain_backbone.sh run: pass a new or empty folder" >&2
  exit 2
fi
mkdir -p "$out"
touch "$out/$marker"
out=$(cd "$out" && pwd)  # torchtitan takes absolute checkpoint paths
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
PY=.venv/bin/python
$PY scripts/build_tokenizer.py > /dev/null
config=backbone_qwen3_pretrain
window=256
steps=${STEPS:-$($PY -c "from train_configs.backbone import PRETRAIN_STEPS; print(PRETRAIN_STEPS)")}
context=$((window - $($PY -c "from torchtitan_ext.data.task_data import MAX_ANSWER_TOKENS; print(MAX_ANSWER_TOKENS)")))

if ! SKIP_SETUP=1 bash scripts/train.sh --module train_configs.backbone --config $config --dump_folder "$out/backbone" \
    --training.steps "$steps" --checkpoint.interval "$steps" --lr_scheduler.warmup_steps $((steps / 10 > 0 ? steps / 10 : 1)) \
    "$@" > "$out/train.log" 2>&1; then
  echo "error: training failed; the end of $out/train.log:" >&2
  tail -n 20 "$out/train.log" >&2
  exit 1
fi
checkpoint=$(ls -d "$out"/backbone/checkpoint/step-* | sort -t- -k2 -n | tail -n 1)
rm -rf "$out/hf"
$PY scripts/convert_to_hf.py --module train_configs.backbone --config $config --checkpoint "$checkpoint" \
  --out "$out/hf" > /dev/null
$PY scripts/eval_tasks.py --tasks s_niah --context-lengths $context --samples "${NIAH_SAMPLES:-200}" --haystack noise \
  --checkpoint "$out/hf" --config train_configs.backbone:$config --label backbone --out "$out/eval" > /dev/null 2> "$out/eval.log"

$PY - "$out" "$checkpoint" $window $context <<'EOF'
"""Write OUT_DIR/niah.json and loss.png from the eval's results.json and the training log; print the summary."""
import json
import sys
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

from torchtitan_ext.training.run_log import parse_steps

out, checkpoint, window, context = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
results = json.loads((out / "eval" / "results.json").read_text())
cell = results["runs"][0]["scores"]["s_niah"][context]["per_seed"][0]
steps = parse_steps((out / "train.log").read_text())
first, last = min(steps), max(steps)
niah = {"window": window, "context_length": int(context), "samples": cell["items"], "exact_match": cell["value"],
        "interval": cell["ci95"], "interval_kind": "95% bootstrap over samples",
        "metric": "share of samples whose greedy answer holds the needle's value (eval_tasks.py, full mode)",
        "haystack": results["haystack"], "steps": last, "loss": [steps[first]["loss"], steps[last]["loss"]],
        "checkpoint": Path(checkpoint).name, "config": "train_configs.backbone:backbone_qwen3_pretrain"}
(out / "niah.json").write_text(json.dumps(niah, indent=1) + "\n")
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(sorted(steps), [steps[n]["loss"] for n in sorted(steps)])
ax.set(xlabel="step", ylabel="training loss (text and task rows)", title="backbone_qwen3_pretrain")
fig.tight_layout()
fig.savefig(out / "loss.png", dpi=100)
low, high = niah["interval"]
print(f"pretrain_backbone: S-NIAH {niah['exact_match']:.3f} [{low:.3f}, {high:.3f}] at {context} tokens "
      f"(window {window}, {niah['samples']} samples), loss {niah['loss'][0]:.3f} -> {niah['loss'][1]:.3f} "
      f"(steps {first}-{last}), Hugging Face folder {out / 'hf'}")
EOF
