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
# Profiler on this GPU: kernels of a 4-layer GPT-7B-shaped stack (bf16, flash-attn when installed,
# else SDPA) from 1K to 32K tokens, activation bytes per token, dispatch; writes a profile JSON
# (all-to-all tables stay the h200-estimate's: one GPU has no group to measure) and plans with it.
timeout 420 .venv/bin/python scripts/profile_cost_model.py --ranks 1 --gpus-per-node 8 --layers 4 \
  --hidden 4096 --heads 32 --ffn 16384 --vocab 50304 --no-swiglu --dtype bf16 --base h200-estimate \
  --lengths 1024,2048,4096,8192,16384,32768 --repeats 3 --port 29612 \
  --out "$OUT/profile_h200_gpt7b-4layers.json" 2>&1 | tail -14 | tee "$OUT/gpu_profile.txt" || true
.venv/bin/python -c "
import sys; from megatron_flexsp.cost_model import CostModel, load_profile; from megatron_flexsp.model_spec import ModelSpec
from megatron_flexsp.planner import plan_step
p = load_profile('$OUT/profile_h200_gpt7b-4layers.json')
cm = CostModel.from_profile(p, ModelSpec('gpt-4x4096-32h', 4, 4096, 32, ffn_hidden_size=16384, vocab_size=50304), num_gpus=8, max_seq_len=32768)
plan = plan_step([32768, 8192, 4096, 2048, 1024, 512, 512, 300], cm)
print('planned with the measured profile:', round(plan.predicted_step_ms, 1), 'ms,', [len(mb.groups) for mb in plan.micro_batches], 'groups per micro-batch')
" 2>&1 | tee -a "$OUT/gpu_profile.txt" || true
