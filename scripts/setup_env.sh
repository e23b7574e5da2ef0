#!/usr/bin/env bash
# Create .venv with Python 3.12 and install megatron-flexsp with its test extras (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

find_python() {
  local cand
  for cand in "${PYTHON312:-}" "$HOME/.pyenv/versions/3.12.1/bin/python" \
              /root/.pyenv/versions/3.12.1/bin/python "$(command -v python3.12 2>/dev/null || true)" \
              "$HOME"/.pyenv/versions/3.12.*/bin/python /root/.pyenv/versions/3.12.*/bin/python; do
    if [ -n "$cand" ] && [ -x "$cand" ] && \
       "$cand" -c 'import sys; raise SystemExit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; raise SystemExit(sys.version_info[:2] != (3, 12))'; then
  PY=$(find_python) || { echo "setup_env: no Python 3.12 found (pyenv 3.12.x or python3.12 on PATH)" >&2; exit 1; }
  echo "setup_env: creating .venv with $PY"
  rm -rf .venv
  "$PY" -m venv .venv
fi
if [ ! -x .venv/bin/flexsp ] || \
   ! (cd / && "$ROOT/.venv/bin/python" -c 'import megatron_flexsp, highspy, hypothesis, tensorboard, torch, megatron.core') 2>/dev/null; then
  echo "setup_env: installing megatron-flexsp[test] (torch, megatron-core, highspy, ...)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test]'
fi
