#!/usr/bin/env bash
# Graft a memory onto a pretrained backbone, offline on 2 CPU cores (about 15 minutes after setup):
#   1. pretrain backbone_qwen3_debug (a 4-block Qwen3) on the embedded corpus and export it
#      as a Hugging Face Qwen3 folder (what a user would download);
#   2. finetune from that folder (--checkpoint.initial_load_in_hf), the backbone frozen:
#      MemoryLlama ALMA + LoRA (memoryllama_alma_debug), and the control with the same LoRA
#      and no memory (backbone_qwen3_debug_lora);
#   3. evaluate the ungrafted backbone and both finetunes (scripts/eval_long_ppl.py) on the
#      held-out documents at the training context (256) and 2x it, with intervals;
#   4. MoNe as its paper trains it: from the same folder, on the synthetic tasks (S-NIAH,
#      MK-NIAH, FWE; loss on the answers), MoNe + LoRA on W_q, W_k, W_v (mone_debug_tasks)
#      and the control with the same LoRA and no memory (mone_control_debug_tasks);
#   5. evaluate both and the ungrafted backbone on the tasks (scripts/eval_tasks.py, streaming:
#      the prompt read once, the answer token by token) at the training length (256) and 2x,
#      4x it: score and answer perplexity with intervals.
# Environment: PRETRAIN_STEPS [400], FINETUNE_STEPS [100], FINETUNE_LR [2e-3, for the first two
# finetunes], TASK_STEPS [200], TASK_SAMPLES [24 per task and length], OUT
# [outputs/graft_demo/<time>], SKIP_SETUP=1. Results: $OUT/eval/results.md and
# $OUT/eval_tasks/results.md (and .json, .png), the logs beside them; docs/benchmarks.md has a
# run's figures and what they show.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
PY=.venv/bin/python
$PY scripts/build_tokenizer.py
pretrain=${PRETRAIN_STEPS:-400} finetune=${FINETUNE_STEPS:-100} finetune_lr=${FINETUNE_LR:-2e-3}
task_steps=${TASK_STEPS:-200} task_samples=${TASK_SAMPLES:-24}
run=${OUT:-outputs/graft_demo/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$run"
run=$(cd "$run" && pwd)  # torchtitan takes absolute checkpoint paths

train() {  # train <name> <config> [flags...]
  local name=$1 config=$2
  shift 2
  echo "graft_demo: training $name ($config; log: $run/$name.log)"
  if ! SKIP_SETUP=1 bash scripts/train.sh --module train_configs.backbone --config "$config" --validator.no-enable \
      --dump_folder "$run/$name" "$@" > "$run/$name.log" 2>&1; then
    echo "graft_demo: $name failed; the end of its log:" >&2
    tail -n 20 "$run/$name.log" >&2
    exit 1
  fi
}

train backbone backbone_qwen3_debug --training.steps "$pretrain" --checkpoint.interval "$pretrain" \
  --lr_scheduler.warmup_steps $((pretrain / 10))
$PY scripts/convert_to_hf.py --module train_configs.backbone --config backbone_qwen3_debug \
  --checkpoint "$run/backbone/checkpoint/step-$pretrain" --out "$run/backbone_hf"
from_hf=(--checkpoint.initial_load_in_hf --checkpoint.initial_load_path "$run/backbone_hf"
         --training.steps "$finetune" --checkpoint.interval "$finetune"
         --optimizer.param-groups.0.optimizer-kwargs.lr "$finetune_lr")
train memory memoryllama_alma_debug "${from_hf[@]}"
train lora_only backbone_qwen3_debug_lora "${from_hf[@]}"

echo "graft_demo: evaluating (log: $run/eval.log)"
$PY scripts/eval_long_ppl.py --dataset embedded --context-lengths 256,512 --max-docs 64 --bucket 128 \
  --checkpoint "$run/backbone_hf" --config train_configs.backbone:backbone_qwen3_debug --label backbone \
  --checkpoint "$run/lora_only/checkpoint/step-$finetune" --config train_configs.backbone:backbone_qwen3_debug_lora \
  --label lora_only \
  --checkpoint "$run/memory/checkpoint/step-$finetune" --config train_configs.backbone:memoryllama_alma_debug \
  --label memoryllama_alma \
  --out "$run/eval" 2> "$run/eval.log"
for name in memory lora_only; do
  $PY scripts/summarize_run.py "$name" "$run/$name.log" "$run/$name"
done

tasks_from_hf=(--checkpoint.initial_load_in_hf --checkpoint.initial_load_path "$run/backbone_hf"
               --training.steps "$task_steps" --checkpoint.interval "$task_steps")
train mone mone_debug_tasks "${tasks_from_hf[@]}"
train mone_control mone_control_debug_tasks "${tasks_from_hf[@]}"
echo "graft_demo: evaluating on the tasks (log: $run/eval_tasks.log)"
$PY scripts/eval_tasks.py --tasks s_niah,mk_niah,fwe --context-lengths 256,512,1024 --samples "$task_samples" \
  --mode streaming --mode streaming --mode streaming \
  --checkpoint "$run/backbone_hf" --config train_configs.backbone:backbone_qwen3_debug --label backbone \
  --checkpoint "$run/mone_control/checkpoint/step-$task_steps" --config train_configs.backbone:mone_control_debug_tasks \
  --label lora_only \
  --checkpoint "$run/mone/checkpoint/step-$task_steps" --config train_configs.backbone:mone_debug_tasks --label mone \
  --out "$run/eval_tasks" 2> "$run/eval_tasks.log"
for name in mone mone_control; do
  $PY scripts/summarize_run.py "$name" "$run/$name.log" "$run/$name"
done
