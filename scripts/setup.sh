#!/usr/bin/env bash
# Make or update .venv with the project's pinned dependencies. Idempotent: when
# pyproject.toml and EXTRAS (e.g. EXTRAS=bench) have not changed since the last successful
# run, it returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian's bible-kjv: the 66 public-domain KJV books, the long held-out documents of the Locas
# whole-book runs (`--dataset kjv`) and their test. Best effort: without apt or root, `--dataset kjv`
# says how to install it and its test is reported skipped.
if ! command -v bible >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  { apt-get install -y -q bible-kjv || { apt-get update -q && apt-get install -y -q bible-kjv; }; } >/dev/null 2>&1 \
    || echo "setup: could not install bible-kjv (the kjv dataset stays unavailable)"
fi
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
