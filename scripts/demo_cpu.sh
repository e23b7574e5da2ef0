#!/usr/bin/env bash
# The main job: a tiny GPT trained with --flexsp on 4 CPU (gloo) ranks, on real documents.
# Sets up .venv if missing, builds the demo dataset once, trains STEPS steps (Megatron's default
# 969,30,1 split of the documents; validation every EVAL_INTERVAL steps), saves a plan picture.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
DATA=${DATA:-data/demo/pystdlib}
OUT=${OUT:-out/demo_cpu}
STEPS=${STEPS:-30}
NPROC=${NPROC:-4}
[ -f "$DATA.idx" ] || .venv/bin/python scripts/prepare_demo_data.py --out "$DATA"
rm -rf "$OUT"; mkdir -p "$OUT"
.venv/bin/torchrun --nproc-per-node "$NPROC" --master-port "${MASTER_PORT:-29533}" \
  pretrain_gpt_flexsp.py ${FLEXSP_FLAG---flexsp --flexsp-config configs/flexsp_demo_cpu.yaml} \
  --flexsp-plan-dir "$OUT" \
  $(bash scripts/tiny_gpt_args.sh) --data-path "$DATA" --train-iters "$STEPS" \
  --eval-interval "${EVAL_INTERVAL:-10}" --eval-iters "${EVAL_ITERS:-2}" \
  --save "$OUT/ckpt" --save-interval "$STEPS" "$@" 2>&1 | tee "$OUT/train.log"
echo "demo_cpu: per-step records in $OUT/steps.jsonl, plans in $OUT/plans.jsonl, picture $OUT/plan_step0.png"
