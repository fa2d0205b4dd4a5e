#!/usr/bin/env bash
# Set up .venv with the eval extra (lm-evaluation-harness; idempotent) and run the full test
# suite, slow tests included, on TEST_WORKERS pytest-xdist workers [2], one test file per worker
# at a time (module fixtures train once), each worker's torch on one thread (OMP_NUM_THREADS).
#   bash scripts/test.sh [pytest args]      e.g. -m "not slow" for the fast part only
#   TEST_WORKERS=0 bash scripts/test.sh     in this process, torch on every core
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS:-eval} bash scripts/setup.sh
.venv/bin/python scripts/build_tokenizer.py
export WANDB_MODE=offline
WORKERS=${TEST_WORKERS:-2}
if [ "$WORKERS" -gt 0 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  exec .venv/bin/python -m pytest -n "$WORKERS" --dist loadfile "$@"
fi
exec .venv/bin/python -m pytest "$@"
