#!/usr/bin/env bash
# Planner demo on the real Wikipedia lengths: all strategies side by side, then one plan as JSON + Gantt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
LENGTHS=${LENGTHS:-../shared/seqlen/flexsp_wikipedia_seqlens.txt}
OUT=${OUT:-out}
mkdir -p "$OUT"
COMMON=(--lengths "$LENGTHS" --global-batch 512 --seed 0 --num-gpus 64 --gpus-per-node 8
        --profile a100-paper --model gpt-7b --max-seq-len 196608)
.venv/bin/flexsp simulate "${COMMON[@]}" --num-batches 4 --json "$OUT/simulate.json"
.venv/bin/flexsp plan "${COMMON[@]}" --num-batches 1 --json "$OUT/plan.json" --plot "$OUT/plan.png"
