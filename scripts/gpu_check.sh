#!/usr/bin/env bash
# The first command to run on a GPU machine (see scripts/gpu_check.py for the checks):
#   bash scripts/gpu_check.sh [--only families,attention,kernels,drift,train,throughput] [--steps 20]
# Without CUDA it prints one line and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
.venv/bin/python scripts/build_tokenizer.py >/dev/null
exec .venv/bin/python scripts/gpu_check.py "$@"
