#!/usr/bin/env bash
# Download the wheels a GPU image with its own torch lacks for training, to install there offline.
#
#   bash scripts/gpu_wheels.sh DIR [--wandb] [NAME ...]
#
# Why: `PYTHON=python3 bash scripts/train.sh ...` runs on an image's own python and torch
# (e.g. torch 2.11+cu130, CPython 3.12), which usually has no network and lacks torchtitan
# 0.3.0 and the pure-Python packages below; the launcher's preflight names what is missing.
# Run this where pip has network (any OS and Python: pip fetches for the target), copy DIR to
# the image and install with the line printed at the end (--no-deps: nothing else is touched).
# Each version is the one the pinned .venv holds (the tested set), or the fallback below when
# there is no .venv. --wandb adds wandb (a manylinux wheel) and the dependencies of it an image
# lacks (without it pass --metrics.no-enable-wandb). NAME: further distributions (pinned
# like the rest), e.g. sentencepiece when preflight names it missing.
# Environment: PYTHON_VERSION [3.12] (the image's CPython), PIP [python3 -m pip].
set -euo pipefail
DIR=${1:?usage: bash scripts/gpu_wheels.sh DIR [--wandb] [NAME ...]}
shift
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)  # relative to the caller's folder, not the checkout's
cd "$(dirname "$0")/.."
# name==fallback version (the pinned .venv's at the time of writing)
BASE=(torchtitan==0.3.0 datasets==4.7.0 tyro==1.0.17 typeguard==4.6.1 docstring-parser==0.18.0
      torch-checkpointing==0.1.1 spmd-types==0.2.3 torchdata==0.11.0 multiprocess==0.70.18 dill==0.4.0
      typing-extensions==4.16.0)  # tyro/typeguard need typing-extensions >= 4.14, newer than some images'
WANDB=(wandb==0.31.0 cwevals==0.0.1b1 distro==1.9.0 sniffio==1.3.1 platformdirs==4.14.8
       opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
       opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
       opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
       opentelemetry-exporter-http-transport==0.66b2 googleapis-common-protos==1.76.0 protobuf==7.36.2
       pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5)
WANTED=("${BASE[@]}")
for arg in "$@"; do
  if [ "$arg" = --wandb ]; then WANTED+=("${WANDB[@]}"); else WANTED+=("$arg"); fi
done

# Pin each name to the .venv's version (else the fallback); one entry per distribution.
PINNED=$(python3 - "${WANTED[@]}" <<'EOF'
import re, subprocess, sys
from pathlib import Path

def key(name):
    return re.sub(r"[-_.]+", "-", name).lower()

venv = {}
if Path(".venv/bin/python").exists():
    out = subprocess.run([".venv/bin/python", "-c", "import importlib.metadata as m\n"
                          "for d in m.distributions(): print(d.metadata['Name'], d.version)"],
                         capture_output=True, text=True, check=True).stdout
    venv = {key(n): v for n, v in (line.split() for line in out.splitlines() if line.strip())}
pins = {}
for spec in sys.argv[1:]:
    name, _, fallback = spec.partition("==")
    version = venv.get(key(name), fallback)
    if not version:
        sys.exit(f"gpu_wheels: no version for {name}: not in .venv, pass {name}==VERSION")
    pins.setdefault(key(name), f"{name}=={version}")
print("\n".join(pins.values()))
EOF
)
mapfile -t PINNED <<<"$PINNED"

# `any` covers the py3-none-any wheels (pip adds none-any for any --platform too); the manylinux
# tags cover wandb's Go core and pydantic-core. A wheel only for another Python fails here.
${PIP:-python3 -m pip} download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$DIR" "${PINNED[@]}"

# A ptxas >= 13.3 for Hopper (kernels/ptxas.py: Triton <= 3.6 assembles sm_90 with ptxas 12.8, which
# has a register-operand wgmma fault; the whole-sequence kernels' tensor-core products (the Hopper default) need the
# fixed one), xz-compressed to fit a carry (12 MiB): scripts/gpu_session.sh unpacks it; the lease's
# kernels check decides whether later sections use it.
NVCC=$(mktemp -d)
${PIP:-python3 -m pip} download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d "$NVCC" "nvidia-cuda-nvcc==${PTXAS_VERSION:-13.5.37}"
python3 -c 'import lzma, shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as w, w.open("nvidia/cu13/bin/ptxas") as src, lzma.open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)' "$NVCC"/nvidia_cuda_nvcc-*.whl "$DIR/ptxas.xz"
rm -rf "$NVCC"

count=$(find "$DIR" -maxdepth 1 -name '*.whl' | wc -l)
mib=$(du -cb "$DIR"/*.whl | tail -1 | awk '{printf "%.1f", $1 / 1048576}')
echo "gpu_wheels: $count wheels, $mib MiB in $DIR (${#PINNED[@]} requested). On the image:"
echo "  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $DIR/*.whl && export PYTHONPATH=/tmp/site"
echo "  and on Hopper the fixed ptxas ($DIR/ptxas.xz; kernels/ptxas.py): python3 -c 'import lzma, shutil; shutil.copyfileobj(lzma.open(\"$DIR/ptxas.xz\"), open(\"/tmp/ptxas\", \"wb\"))' && chmod +x /tmp/ptxas && export TRITON_PTXAS_PATH=/tmp/ptxas"
