#!/usr/bin/env bash
# The first command to run on a GPU machine (see scripts/gpu_check.py for the checks):
#   bash scripts/gpu_check.sh [--only families,attention,kernels,drift,train,throughput] [--steps 20]
# Without CUDA it prints one line and exits 0. Without --only it then runs scripts/bench_models.py.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
.venv/bin/python scripts/build_tokenizer.py >/dev/null
.venv/bin/python scripts/gpu_check.py "$@"
# With no --only: every family's paper flavor trained in a plain loop (no torchtitan, so any
# torch >= 2.11 with CUDA), tokens/s and MFU (scripts/bench_models.py).
if [ $# -eq 0 ] && .venv/bin/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  .venv/bin/python scripts/bench_models.py --device cuda --seq-len 4096 --compile
fi
