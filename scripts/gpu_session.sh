#!/usr/bin/env bash
# The one prepared script of a GPU lease: <= 9 minutes on one H100, with the image's own torch
# (>= 2.11) and the pure-Python wheels it lacks (scripts/gpu_wheels.sh) installed from a folder.
#
#   bash scripts/gpu_session.sh [--only main,perf] [--models transformer,mela,titans_mac] [--steps 2]
#       [--budget-s 510] [--out DIR] [--dry-run]
#
# Environment (defaults in brackets):
#   PYTHON   the interpreter with torch [python3 where .venv is absent, else .venv/bin/python]
#   WHEELS   a folder of wheels installed with pip --target /tmp/site and put on PYTHONPATH
#            when PYTHON has no torchtitan [.whl]; made where pip has network by
#            `bash scripts/gpu_wheels.sh .whl`, which also packs WHEELS/ptxas.xz
#   FIXED_PTXAS  a ptxas >= 13.3 for Triton [WHEELS/ptxas.xz unpacked to /tmp/fixed_ptxas/bin/ptxas]
# On the device tool: carry .whl, and `bash scripts/gpu_session.sh --out $OUT`.
# `--dry-run` (CPU is fine) prints every command and checks that each parses. What each section
# does and reports: scripts/gpu_session.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHON
WHEELS=${WHEELS:-.whl}
if ! "$PYTHON" -c "import torchtitan" 2>/dev/null && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The fixed ptxas gpu_wheels.sh packed (kernels/ptxas.py): FIXED_PTXAS for scripts/gpu_session.py.
if [ -z "${FIXED_PTXAS:-}" ] && [ -f "$WHEELS/ptxas.xz" ]; then
  FIXED_PTXAS=/tmp/fixed_ptxas/bin/ptxas
  mkdir -p "$(dirname "$FIXED_PTXAS")"
  "$PYTHON" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    "$WHEELS/ptxas.xz" "$FIXED_PTXAS"
  chmod +x "$FIXED_PTXAS"
  export FIXED_PTXAS
fi
"$PYTHON" scripts/build_tokenizer.py >/dev/null
exec "$PYTHON" scripts/gpu_session.py "$@"
