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
# Megatron integration on the GPU (not CPU mode): one rank, NCCL, bf16, our core attention with the
# best installed backend (auto: flash-attn), 5 steps of the demo model on the demo documents.
DATA=data/demo/pystdlib
[ -f "$DATA.idx" ] || .venv/bin/python scripts/prepare_demo_data.py --out "$DATA" --max-docs 2000
ARGS=$(bash scripts/tiny_gpt_args.sh | sed -e 's/--use-cpu-initialization//')
timeout 300 .venv/bin/torchrun --nproc-per-node 1 --master-port 29611 pretrain_gpt_flexsp.py --flexsp \
  --flexsp-cpu off --flexsp-plan-dir "$OUT/gpu_train" $ARGS --bf16 --data-path "$DATA" \
  --train-iters 5 2>&1 | grep -E "flexsp step|iteration +[0-9]+/|Error|error" | tee "$OUT/gpu_train.txt" || true
