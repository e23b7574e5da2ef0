#!/usr/bin/env bash
# One call on a GPU machine: set up (CPU-only packages are fine; flash-attn / TE are used when
# present), run the CPU test suite's runtime part and the GPU attention checks. Results under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
bash scripts/setup_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
.venv/bin/python -m pytest -q tests/runtime 2>&1 | tail -3 | tee "$OUT/runtime_tests.txt"
OUT="$OUT" .venv/bin/python scripts/gpu_check.py 2>&1 | tee "$OUT/gpu_check.txt"
