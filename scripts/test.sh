#!/usr/bin/env bash
# Set up .venv with the eval extra (lm-evaluation-harness; idempotent) and run the full test
# suite, slow tests included.
#   bash scripts/test.sh [pytest args]      e.g. -m "not slow" for the fast part only
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS:-eval} bash scripts/setup.sh
.venv/bin/python scripts/build_tokenizer.py
export WANDB_MODE=offline
exec .venv/bin/python -m pytest "$@"
