#!/usr/bin/env bash
# Locas whole-book test-time training at small scale, offline on 2 CPU cores, ~25 min (the paper's
# PG-19 protocol on text no model here trained on):
#   1. pretrain backbone_qwen3_debug (a 4-block Qwen3) on the embedded corpus and export it as
#      a Hugging Face folder; pretrain mlp_lm_debug (the MLP-FFN LM) the same way;
#   2. on the Qwen3: truncated attention, full attention, TempLoRA and Locas-GLU with the
#      init ablation (top-K, bottom-K, random selection, Gaussian, normalised activations),
#      and the merged Locas-GLU export of the last document (a plain Qwen3ForCausalLM);
#   3. on the MLP-FFN LM: truncated, TempLoRA, Locas-MLP + BP and Locas-MLP + NL-SVD;
#   4. the Locas-GLU init ablation again at the paper's lr 4e-3 (step 2 uses lr 1.0).
# Each document is read chunk by chunk (CHUNK [128]) in a WINDOW [256] (the training context),
# scored before anything learns from it; results: $OUT/{glu,mlp,glu_lr4e-3}/results.md
# (and .json, cumulative_ppl.png). Documents: DOCS, a folder of text files (default: the
# license texts of /usr/share/common-licenses, 0.4-9k tokens each, copied as .txt, less GPL-1:
# the learning rates and Locas-MLP's eps were chosen on it, docs/benchmarks.md); or PG-19 books
# you have; or DOCS=kjv: the first KJV_DOCS [24] books of the King James Bible of 8K+ tokens
# (Debian's bible-kjv: apt-get install bible-kjv), each cut to its first 8,193 tokens.
# Environment: PRETRAIN_STEPS [400], RANK [16], SEEDS [0] (e.g. 0,1,2: TempLoRA and the random
# inits once per seed), OUT [outputs/locas_demo/<time>], SKIP_SETUP=1. docs/benchmarks.md has a
# run's figures and what they show.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
PY=.venv/bin/python
$PY scripts/build_tokenizer.py
pretrain=${PRETRAIN_STEPS:-400} rank=${RANK:-16} chunk=${CHUNK:-128} window=${WINDOW:-256}
run=${OUT:-outputs/locas_demo/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$run/books"
run=$(cd "$run" && pwd)
docs=${DOCS:-/usr/share/common-licenses} tuned_on=${DOCS:+none}
if [ "$docs" = kjv ]; then
  command -v bible > /dev/null || { echo "locas_demo: DOCS=kjv needs Debian's bible-kjv: apt-get install bible-kjv" >&2; exit 2; }
  dataset=(--dataset kjv --split all --min-doc-tokens 8193 --max-doc-tokens 8193 --max-docs "${KJV_DOCS:-24}")
else
  [ -d "$docs" ] || { echo "locas_demo: no folder '$docs': set DOCS to a folder of long text files, or DOCS=kjv" >&2; exit 2; }
  for f in "$docs"/*; do
    name=$(basename "${f%.txt}")
    [ -f "$f" ] && [ ! -L "$f" ] && [ "$name" != "${tuned_on:-GPL-1}" ] && cp "$f" "$run/books/$name.txt"
  done
  dataset=(--dataset "$run/books" --split all --min-doc-tokens $((2 * chunk)) --max-docs 32)
fi

train() {  # train <name> <module> <config>
  echo "locas_demo: pretraining $3 (log: $run/$1.log)"
  if ! SKIP_SETUP=1 bash scripts/train.sh --module "$2" --config "$3" --validator.no-enable --dump_folder "$run/$1" \
      --training.steps "$pretrain" --checkpoint.interval "$pretrain" --lr_scheduler.warmup_steps $((pretrain / 10)) \
      > "$run/$1.log" 2>&1; then
    echo "locas_demo: $1 failed; the end of its log:" >&2
    tail -n 20 "$run/$1.log" >&2
    exit 1
  fi
}
train backbone train_configs.backbone backbone_qwen3_debug
$PY scripts/convert_to_hf.py --module train_configs.backbone --config backbone_qwen3_debug \
  --checkpoint "$run/backbone/checkpoint/step-$pretrain" --out "$run/backbone_hf"
train mlp_lm train_configs.mlp_lm mlp_lm_debug

common=("${dataset[@]}" --chunk "$chunk" --window "$window" --ttt-rank "$rank" --probe-docs 8 --templora-lr 4e-3
        --seeds "${SEEDS:-0}")
echo "locas_demo: whole-book test-time training on the Qwen3 (log: $run/glu.log)"
$PY scripts/eval_long_ppl.py "${common[@]}" --checkpoint "$run/backbone_hf" \
  --config train_configs.backbone:backbone_qwen3_debug --out "$run/glu" --merge-out "$run/merged_hf" \
  --ttt-lr 1.0 --full-window 2048 \
  --ttt truncated,full,templora,locas_glu,locas_glu:bottomk,locas_glu:random_select,locas_glu:gaussian,locas_glu:norm_act \
  > "$run/glu.log" 2>&1 || { tail -n 20 "$run/glu.log" >&2; exit 1; }
echo "locas_demo: whole-book test-time training on the MLP-FFN LM (log: $run/mlp.log)"
$PY scripts/eval_long_ppl.py "${common[@]}" --checkpoint "$run/mlp_lm/checkpoint/step-$pretrain" \
  --config train_configs.mlp_lm:mlp_lm_debug --out "$run/mlp" --ttt-lr 4e-2 --value-scale 0.1 \
  --ttt truncated,templora,locas_mlp:bp,locas_mlp:nlsvd > "$run/mlp.log" 2>&1 || { tail -n 20 "$run/mlp.log" >&2; exit 1; }
echo "locas_demo: Locas-GLU's init ablation at the paper's lr 4e-3 (log: $run/glu_lr4e-3.log)"
$PY scripts/eval_long_ppl.py "${common[@]}" --checkpoint "$run/backbone_hf" \
  --config train_configs.backbone:backbone_qwen3_debug --out "$run/glu_lr4e-3" --ttt-lr 4e-3 \
  --ttt truncated,locas_glu,locas_glu:bottomk,locas_glu:random_select,locas_glu:gaussian,locas_glu:norm_act \
  > "$run/glu_lr4e-3.log" 2>&1 || { tail -n 20 "$run/glu_lr4e-3.log" >&2; exit 1; }
cat "$run/glu/results.md" "$run/mlp/results.md" "$run/glu_lr4e-3/results.md"
echo "locas_demo: results in $run/glu and $run/mlp; the merged Locas-GLU model in $run/merged_hf"
