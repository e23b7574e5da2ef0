#!/usr/bin/env bash
# Every GPU check in one call on the offline GPU machine (no network; Python 3.12 with a CUDA torch;
# wheels carried in .whl/ by scripts/fetch_device_wheels.sh). Each stage has its own exit status, so
# one failure does not stop the others; at most 8 files are written to $OUT:
#   summary.txt (one line per stage), device.log (every stage's output), gpu_check.json,
#   train_steps.jsonl (the Megatron run), h200-measured-1gpu.json (the profile), plan.json.
# Usage:  OUT=out/device bash scripts/gpu_check_device.sh         (STAGES="install runtime ..." to pick)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-out/device}
PY=${PYTHON:-python3}
STAGES=${STAGES:-"install runtime backends train profile plan"}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
LOG="$OUT/device.log"
: > "$LOG"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
failed=0

run_stage() {  # name (a function below), time limit in seconds
  local name=$1 limit=$2 start status
  case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
  start=$(date +%s)
  echo "===== stage $name" >> "$LOG"
  timeout "$limit" bash -c "set -o pipefail; $name" >> "$LOG" 2>&1
  status=$?
  local verdict=PASS
  [ $status -eq 0 ] || { verdict=FAIL; failed=$((failed + 1)); }
  [ $status -eq 124 ] && verdict="FAIL (timed out after ${limit} s)"
  echo "$verdict $name ($(( $(date +%s) - start )) s, exit $status)" | tee -a "$OUT/summary.txt"
}

# 1. install the carried wheels that are missing, offline and without their dependencies; never torch
install() {
  local before after missing=() pair
  before=$($PY -c "import torch; print(torch.__version__)") || { echo "no torch in $PY"; return 1; }
  for pair in numpy:numpy packaging:packaging yaml:pyyaml psutil:psutil highspy:highspy \
              megatron.core:megatron-core pygments:pygments iniconfig:iniconfig pluggy:pluggy \
              pytest:pytest; do
    $PY -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair##*:}")
  done
  echo "torch $before; installing from .whl: ${missing[*]:-nothing}"
  if [ ${#missing[@]} -gt 0 ]; then
    $PY -m pip install --no-index --no-deps --find-links "$ROOT/.whl" "${missing[@]}" || return 1
  fi
  after=$($PY -c "import torch; print(torch.__version__)")
  [ "$before" = "$after" ] || { echo "torch changed: $before -> $after"; return 1; }
  $PY -c "import megatron.core, highspy, yaml, numpy; import megatron_flexsp.planner; print('imports ok')"
}

# 2. the runtime tests (CPU ranks; one GPU is enough)
runtime() { $PY -m pytest -q -p no:cacheprovider tests/runtime; }

# 3. attention backends on the GPU against the reference, bf16
backends() { OUT="$OUT" $PY scripts/gpu_check.py; }

# 4. five Megatron --flexsp steps in GPU mode: NCCL, bf16, Transformer Engine's layers when it imports
train() {
  local data=data/demo/pystdlib impl=local args
  [ -f "$data.idx" ] || $PY scripts/prepare_demo_data.py --out "$data" --max-docs 2000 || return 1
  $PY -c "import transformer_engine.pytorch" 2>/dev/null && impl=transformer_engine
  args=$(bash scripts/tiny_gpt_args.sh | sed -e 's/--use-cpu-initialization//')
  # shellcheck disable=SC2086
  $PY -m torch.distributed.run --nproc-per-node 1 --master-port 29611 pretrain_gpt_flexsp.py --flexsp \
    --flexsp-cpu off --flexsp-plan-dir "$WORK/train" $args --transformer-impl "$impl" --bf16 \
    --data-path "$data" --train-iters 5 || return 1
  cp "$WORK/train/steps.jsonl" "$OUT/train_steps.jsonl"
}

# 5. a 4-layer GPT-7B-shaped stack profiled on this GPU (lengths capped by its memory)
profile() {
  $PY scripts/profile_cost_model.py --ranks 1 --gpus-per-node 8 --layers 4 --hidden 4096 --heads 32 \
    --ffn 16384 --vocab 50304 --no-swiglu --dtype bf16 --base h200-estimate \
    --lengths 1024,2048,4096,8192,16384,32768 --repeats 3 --port 29612 \
    --out "$OUT/h200-measured-1gpu.json"
}

# 6. a plan made with that profile
plan() {
  $PY - "$OUT/h200-measured-1gpu.json" "$OUT/plan.json" <<'PYEOF'
import json, sys
from megatron_flexsp.cost_model import CostModel, load_profile
from megatron_flexsp.model_spec import ModelSpec
from megatron_flexsp.planner import plan_step
prof = load_profile(sys.argv[1])
spec = ModelSpec("gpt-4x4096-32h", 4, 4096, 32, ffn_hidden_size=16384, vocab_size=50304)
cm = CostModel.from_profile(prof, spec, num_gpus=8, max_seq_len=32768)
plan = plan_step([32768, 8192, 4096, 2048, 1024, 512, 512, 300], cm)
print("planned with the measured profile:", round(plan.predicted_step_ms, 1), "ms, gap",
      f"{plan.gap:.2%},", plan.group_sizes)
json.dump({"cost_model": cm.describe(), "plan": plan.to_dict()}, open(sys.argv[2], "w"), indent=1)
PYEOF
}

export ROOT OUT PY WORK LOG
export -f install runtime backends train profile plan
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LOG" 2>&1
run_stage install 120
run_stage runtime 180
run_stage backends 120
run_stage train 180
run_stage profile 240
run_stage plan 60
echo "gpu_check_device: $failed stage(s) failed" | tee -a "$OUT/summary.txt"
exit $(( failed > 0 ))
