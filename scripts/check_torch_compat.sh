#!/usr/bin/env bash
# Does the project train the same under another torch release as under the pinned one?
#   bash scripts/check_torch_compat.sh VERSION [--dry-run] [--steps N]      e.g. VERSION=2.11
# Builds (when missing) the side environment .venv-torch$VERSION: python3 -m venv, torch==VERSION
# from PyPI (on Linux its CUDA build, about 4.6 GB; set PIP_INDEX_URL for another index), then the
# project's dependencies from pyproject.toml without the torch pin, under a pip constraint file
# holding torch==VERSION so that nothing replaces it. The project itself is not installed there:
# scripts/train.sh puts the checkout on PYTHONPATH (PYTHON=...). Then scripts/check_torch_compat.py,
# run by the pinned .venv, trains transformer_debug and mela_debug on 1 and 2 ranks, eager and
# compiled, under both torches from one seed checkpoint per config and prints one line per case
# (the criterion of "equal" is in its docstring); exit 0 only when every case is equal. Results in
# outputs/torch_compat/<date-time>/results.txt. About 16 CPU training runs: an hour or more on 2 cores.
# --dry-run prints the commands (the environment's build too, when it is missing) and runs nothing.
# Other arguments go to the .py (--configs, --ranks, --modes, --timeout, --out). Not in CI.
# SKIP_SETUP=1 skips scripts/setup.sh (the pinned .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-}
if [ -z "$VERSION" ] || [[ "$VERSION" == -* ]]; then
  echo "usage: bash scripts/check_torch_compat.sh VERSION [--dry-run] [--steps N]   (e.g. 2.11)" >&2
  exit 2
fi
shift
DRY=0
for arg in "$@"; do [ "$arg" = --dry-run ] && DRY=1; done
VENV=.venv-torch$VERSION

# The environment counts as built when its torch is VERSION (2.11 == 2.11.0) and torchtitan imports.
ready() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VERSION" <<'EOF' >/dev/null 2>&1
import sys
import torch, torchtitan  # noqa: F401
def parts(v):
    p = [int(x) for x in v.split("+")[0].split(".")[:3]]
    return p + [0] * (3 - len(p))
sys.exit(parts(torch.__version__) != parts(sys.argv[1]))
EOF
}

# pyproject.toml's dependencies without torch's, one a line.
dependencies() {
  python3 - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower() != "torch"))
EOF
}

step() {  # print (quoted for a shell), and run unless --dry-run
  echo "+ ${*@Q}"
  [ "$DRY" = 1 ] || "$@"
}

if ! ready; then
  echo "check_torch_compat: building $VENV (torch==$VERSION)" >&2
  [ -x "$VENV/bin/python" ] || step python3 -m venv "$VENV"
  step "$VENV/bin/pip" install -q --disable-pip-version-check "torch==$VERSION"
  if [ "$DRY" = 1 ]; then
    echo "+ echo torch==$VERSION > $VENV/constraints.txt"
  else
    echo "torch==$VERSION" > "$VENV/constraints.txt"
  fi
  mapfile -t deps < <(dependencies)
  step "$VENV/bin/pip" install -q --disable-pip-version-check -c "$VENV/constraints.txt" "${deps[@]}"
  if [ "$DRY" = 0 ] && ! ready; then
    echo "check_torch_compat: $VENV does not import torch $VERSION and torchtitan" >&2
    exit 1
  fi
fi

if [ "$DRY" = 1 ]; then
  [ "${SKIP_SETUP:-0}" = 1 ] || echo "+ bash scripts/setup.sh"
else
  [ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
fi
exec .venv/bin/python scripts/check_torch_compat.py --side-python "$PWD/$VENV/bin/python" --label "$VERSION" "$@"
