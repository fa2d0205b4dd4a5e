#!/usr/bin/env bash
# Set up, then train transformer_debug, titans_mac_debug and mela_debug on the embedded
# corpus (no network needed). Each run logs to a file; the console ends with one line per
# model: loss fall, throughput, checkpoint. About 10 minutes on 2 CPU cores, setup included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/build_tokenizer.py
run=outputs/demo/$(date +%Y%m%d-%H%M%S)
mkdir -p "$run"
configs=(transformer:transformer_debug titans:titans_mac_debug mela:mela_debug)
for entry in "${configs[@]}"; do
  family=${entry%%:*} config=${entry#*:}
  echo "demo: training $config (log: $run/$config.log)"
  if ! SKIP_SETUP=1 bash scripts/train.sh --module "train_configs.$family" --config "$config" \
      --dump_folder "$run/$config" > "$run/$config.log" 2>&1; then
    echo "demo: $config failed; the end of its log:" >&2
    tail -n 20 "$run/$config.log" >&2
    exit 1
  fi
done
for entry in "${configs[@]}"; do
  config=${entry#*:}
  .venv/bin/python scripts/summarize_run.py "$config" "$run/$config.log" "$run/$config"
done
