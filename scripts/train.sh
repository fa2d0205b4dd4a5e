#!/usr/bin/env bash
# Train with torchtitan's Trainer through torchrun, on one node or many (one process: no torchrun).
#
#   bash scripts/train.sh --module train_configs.<family> --config <function> [--section.key value ...]
#   bash scripts/train.sh --list                      # the config catalogue
#
# Environment (defaults in brackets):
#   NPROC_PER_NODE  processes per node [number of GPUs, or 1 without GPUs]
#   NNODES          nodes [1]; with NNODES>1 set MASTER_ADDR (and MASTER_PORT [29500]),
#                   NODE_RANK is not needed (c10d rendezvous assigns ranks)
#   RDZV_ID         rendezvous id shared by all nodes of one job [mnlm]
#   LOG_DIR         per-rank stdout/stderr logs [outputs/logs/<date-time>-<pid>]
#   WANDB_MODE      [offline unless WANDB_API_KEY is set]
#   SKIP_SETUP=1    skip `scripts/setup.sh` (e.g. on cluster nodes sharing one checkout)
#   PYTHON          an interpreter that already has torch (>= 2.11) and the project's dependencies,
#                   e.g. a GPU image's own `python3`, used instead of .venv: setup is skipped (it
#                   would install the pinned torch), the checkout is put on PYTHONPATH, and the
#                   launcher's checks name any missing package (scripts/gpu_wheels.sh fetches them)
#   SKIP_PREFLIGHT=1  skip the launcher's checks (every rank runs them again, without the scan
#                   of local data rows; bad input then fails inside torchrun, not with exit 2)
#   MEMORY_BUDGET=1  on CUDA, the launcher's checks also predict the peak memory per rank and
#                   warn when it exceeds 90% of the GPU's (torchtitan_ext/training/memory_budget.py;
#                   1.5-13 minutes at the papers' shapes)
# Without an accelerator the run uses gloo and the CPU support in torchtitan_ext/training/cpu.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  [ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
  PY=.venv/bin/python
fi

if [ "${1:-}" = "--list" ]; then exec "$PY" -m torchtitan_ext.catalogue; fi

if [ -z "${WANDB_MODE:-}" ] && [ -z "${WANDB_API_KEY:-}" ]; then export WANDB_MODE=offline; fi
export WANDB_DIR=${WANDB_DIR:-outputs}
mkdir -p "$WANDB_DIR"

if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$(command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | wc -l || echo 0)
  [ "$NPROC_PER_NODE" -gt 0 ] || NPROC_PER_NODE=1
fi
NNODES=${NNODES:-1}
# Bad input ends here with one line and exit code 2, before torchrun starts.
if [ "${SKIP_PREFLIGHT:-0}" != 1 ]; then
  WORLD_SIZE=$((NNODES * NPROC_PER_NODE)) "$PY" -m torchtitan_ext.training.preflight "$@"
fi
LOG_DIR=${LOG_DIR:-outputs/logs/$(date +%Y%m%d-%H%M%S)-$$}
mkdir -p "$LOG_DIR"

if [ "$NNODES" = 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
  rdzv=(--standalone)
else
  rdzv=(--rdzv_backend c10d --rdzv_endpoint "${MASTER_ADDR:?set MASTER_ADDR for multi-node}:${MASTER_PORT:-29500}"
        --rdzv_id "${RDZV_ID:-mnlm}")
fi
echo "train: $NNODES node(s) x $NPROC_PER_NODE process(es); per-rank logs in $LOG_DIR" >&2
# Preemption (SIGTERM): the ranks checkpoint their last finished step and rank 0 leaves
# PREEMPTED_MARKER; this script then exits 75 (rerun to resume; slurm_train.sbatch requeues).
# The trap keeps this shell alive until torchrun has finished.
export PREEMPTED_MARKER="$LOG_DIR/preempted"
# torchrun exits 1 whatever a rank's code; rank 0 leaves its code (2 bad input, 3 non-finite
# steps, 4 disk full) in EXIT_CODE_FILE, and this script exits with it.
export EXIT_CODE_FILE="$LOG_DIR/exit_code"
trap 'true' TERM
status=0
if [ "$NNODES" = 1 ] && [ "$NPROC_PER_NODE" = 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
  # One process on one node: the rank runs here, without torchrun's agent (its start costs
  # ~4 s on 2 CPU cores), in the environment torchrun would give it (its store on a free
  # port); its output goes to the console and to LOG_DIR/rank0.{stdout,stderr}.log. The tees
  # ignore SIGTERM, so a preempted rank can still report its checkpoint.
  RANK=0 LOCAL_RANK=0 GROUP_RANK=0 ROLE_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 GROUP_WORLD_SIZE=1 ROLE_WORLD_SIZE=1 \
    MASTER_ADDR=127.0.0.1 MASTER_PORT=0 "$PY" -m torchtitan_ext.training.train "$@" \
    > >(trap '' TERM; exec tee "$LOG_DIR/rank0.stdout.log") \
    2> >(trap '' TERM; exec tee "$LOG_DIR/rank0.stderr.log" >&2) || status=$?
  wait || true  # for the tees to flush (their status is not the run's)
else
  "$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" "${rdzv[@]}" \
    --log-dir "$LOG_DIR" --redirects 3 --tee 3 --local-ranks-filter 0 \
    -m torchtitan_ext.training.train "$@" || status=$?
fi
if [ -f "$PREEMPTED_MARKER" ]; then exit 75; fi
if [ "$status" != 0 ] && [ -f "$EXIT_CODE_FILE" ]; then exit "$(cat "$EXIT_CODE_FILE")"; fi
exit "$status"
