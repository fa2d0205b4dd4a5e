#!/usr/bin/env bash
# Make or update .venv with the project's pinned dependencies. Idempotent: when
# pyproject.toml and EXTRAS (e.g. EXTRAS=bench) have not changed since the last successful
# run, it returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.setup-stamp
want="$(sha256sum pyproject.toml | cut -d' ' -f1) extras=${EXTRAS:-}"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# torch first, pinned, so no other package pulls a multi-GB CUDA build on CPU machines.
"$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0"
"$VENV/bin/pip" install -q --disable-pip-version-check -e ".${EXTRAS:+[$EXTRAS]}"
echo "$want" > "$STAMP"
echo "setup: .venv ready ($("$VENV/bin/python" -c 'import torch, torchtitan; print("torch", torch.__version__, "torchtitan", torchtitan.__version__)'))"
