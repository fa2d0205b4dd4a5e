#!/usr/bin/env bash
# The first command to run on a GPU machine (see scripts/gpu_check.py for the checks):
#   bash scripts/gpu_check.sh [--only families,attention,kernels,drift,train,throughput] [--steps 20]
# Without CUDA it prints one line and exits 0. Without --only it then runs scripts/bench_models.py.
# On an image whose own torch (>= 2.11) should run it instead of the pinned .venv (as for
# scripts/train.sh: setup skipped, the checkout on PYTHONPATH):
#   PYTHON=python3 bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  [ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
  PYTHON=.venv/bin/python
fi
"$PYTHON" scripts/build_tokenizer.py >/dev/null
"$PYTHON" scripts/gpu_check.py "$@"
# With no --only: every family's paper flavor trained in a plain loop (no torchtitan, so any
# torch >= 2.11 with CUDA), tokens/s and MFU (scripts/bench_models.py).
if [ $# -eq 0 ] && "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  "$PYTHON" scripts/bench_models.py --device cuda --seq-len 4096 --compile
fi
