#!/usr/bin/env bash
# Locas whole-book test-time training at small scale, offline on 2 CPU cores (the paper's
# PG-19 protocol on text no model here trained on):
#   1. pretrain backbone_qwen3_debug (a 4-block Qwen3) on the embedded corpus and export it as
#      a Hugging Face folder; pretrain mlp_lm_debug (the MLP-FFN LM) the same way;
#   2. on the Qwen3: truncated attention, full attention, TempLoRA and Locas-GLU with the
#      init ablation (top-K, bottom-K, random selection, Gaussian, normalised activations),
#      and the merged Locas-GLU export of the last document (a plain Qwen3ForCausalLM);
#   3. on the MLP-FFN LM: truncated, TempLoRA, Locas-MLP + BP and Locas-MLP + NL-SVD.
# Each document is read chunk by chunk (CHUNK [128]) in a WINDOW [256] (the training context),
# scored before anything learns from it; results: $OUT/glu/results.md and $OUT/mlp/results.md
# (and .json, cumulative_ppl.png). Documents: DOCS, a folder of text files (default: the
# license texts of /usr/share/common-licenses, 3-9k tokens each, copied as .txt); or a PG-19
# book you have. Environment: PRETRAIN_STEPS [400], RANK [16], OUT [outputs/locas_demo/<time>],
# SKIP_SETUP=1. docs/benchmarks.md has a run's figures and what they show.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
PY=.venv/bin/python
$PY scripts/build_tokenizer.py
pretrain=${PRETRAIN_STEPS:-400} rank=${RANK:-16} chunk=${CHUNK:-128} window=${WINDOW:-256}
run=${OUT:-outputs/locas_demo/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$run/books"
run=$(cd "$run" && pwd)
docs=${DOCS:-/usr/share/common-licenses}
[ -d "$docs" ] || { echo "locas_demo: no folder '$docs': set DOCS to a folder of long text files" >&2; exit 2; }
for f in "$docs"/*; do [ -f "$f" ] && [ ! -L "$f" ] && cp "$f" "$run/books/$(basename "${f%.txt}").txt"; done

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

common=(--dataset "$run/books" --split all --min-doc-tokens $((2 * chunk)) --max-docs 32 --chunk "$chunk"
        --window "$window" --ttt-rank "$rank" --probe-docs 8)
echo "locas_demo: whole-book test-time training on the Qwen3 (log: $run/glu.log)"
$PY scripts/eval_long_ppl.py "${common[@]}" --checkpoint "$run/backbone_hf" \
  --config train_configs.backbone:backbone_qwen3_debug --out "$run/glu" --merge-out "$run/merged_hf" \
  --ttt truncated,full,templora,locas_glu,locas_glu:bottomk,locas_glu:random_select,locas_glu:gaussian,locas_glu:norm_act \
  > "$run/glu.log" 2>&1 || { tail -n 20 "$run/glu.log" >&2; exit 1; }
echo "locas_demo: whole-book test-time training on the MLP-FFN LM (log: $run/mlp.log)"
$PY scripts/eval_long_ppl.py "${common[@]}" --checkpoint "$run/mlp_lm/checkpoint/step-$pretrain" \
  --config train_configs.mlp_lm:mlp_lm_debug --out "$run/mlp" \
  --ttt truncated,templora,locas_mlp:bp,locas_mlp:nlsvd > "$run/mlp.log" 2>&1 || { tail -n 20 "$run/mlp.log" >&2; exit 1; }
cat "$run/glu/results.md" "$run/mlp/results.md"
echo "locas_demo: results in $run/glu and $run/mlp; the merged Locas-GLU model in $run/merged_hf"
