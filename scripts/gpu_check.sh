#!/usr/bin/env bash
# Every GPU check on a GPU machine with network access: set up .venv (flash-attn / Transformer Engine
# are used when installed there), then the stages of scripts/gpu_check_device.sh -- the runtime
# tests, the attention backends against the reference, 5 Megatron --flexsp steps on the GPU, a
# profile of a 4-layer GPT-7B-shaped stack and a plan made with it -- each with its own status.
# Results under $OUT (at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || exit 1
PYTHON=.venv/bin/python STAGES="runtime backends train profile plan" OUT=${OUT:-out/gpu_check} \
  bash scripts/gpu_check_device.sh
