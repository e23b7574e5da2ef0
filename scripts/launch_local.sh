#!/usr/bin/env bash
# Train on one node with torchrun: NPROC ranks (default: all GPUs, or 4 CPU ranks without a GPU).
#   ARGS_FILE=configs/gpt7b_64gpu_192k.args DATA_PATH=/data/wiki_text_document \
#   CKPT_DIR=/ckpt/run1 bash scripts/launch_local.sh [extra Megatron / --flexsp-* flags]
# ARGS_FILE holds Megatron and --flexsp* flags (comments allowed); extra flags override them.
# DATA_PATH (a Megatron indexed dataset prefix) is optional when ARGS_FILE has its own --data-path.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${ARGS_FILE:?set ARGS_FILE to a Megatron arguments file, e.g. configs/gpt7b_64gpu_192k.args}"
PY=${PYTHON:-.venv/bin/python}
if [ -z "${NPROC:-}" ]; then
  NPROC=$("$PY" -c 'import torch; print(torch.cuda.device_count() or 4)')
fi
mapfile -t FILE_ARGS < <(sed -e 's/#.*//' "$ARGS_FILE" | xargs -n1)
DATA=()
[ -n "${DATA_PATH:-}" ] && DATA=(--data-path "$DATA_PATH")
CKPT=()
[ -n "${CKPT_DIR:-}" ] && CKPT=(--save "$CKPT_DIR" --load "$CKPT_DIR")
export CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  pretrain_gpt_flexsp.py "${FILE_ARGS[@]}" "${DATA[@]}" "${CKPT[@]}" "$@"
