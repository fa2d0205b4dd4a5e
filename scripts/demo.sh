#!/usr/bin/env bash
# Set up, then train transformer_debug and mela_debug on the embedded corpus (no network
# needed) and report, for each, the loss, throughput and where the DCP checkpoint landed.
# About 3 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/build_tokenizer.py
run=outputs/demo/$(date +%Y%m%d-%H%M%S)
mkdir -p "$run"
for config in transformer_debug mela_debug; do
  family=${config%_debug}
  SKIP_SETUP=1 bash scripts/train.sh --module "train_configs.$family" --config "$config" \
    --dump_folder "$run/$config" 2>&1 | tee "$run/$config.log"
done
for config in transformer_debug mela_debug; do
  echo "== $config =="
  .venv/bin/python scripts/summarize_run.py "$run/$config.log" "$run/$config"
done
