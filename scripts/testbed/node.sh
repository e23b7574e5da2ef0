#!/usr/bin/env bash
# One node of a multi-node torchrun job, as scripts/slurm/train_flexsp.sbatch starts it: c10d
# rendezvous at node 0's address. Meant to run inside scripts/testbed/two_nodes.sh, which sets
# NODE_RANK, NODE_ADDR, MASTER_ADDR and GLOO_SOCKET_IFNAME; NPROC ranks per node (default 2),
# PORT (default 29555), JOB (rendezvous id). Usage:  node.sh SCRIPT.py [ARGS...]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
IS_HOST=false
[ "$NODE_RANK" = 0 ] && IS_HOST=true  # node 0 runs the rendezvous store
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_VISIBLE_DEVICES=""
exec "$PY" -m torch.distributed.run --nnodes 2 --nproc-per-node "${NPROC:-2}" --node-rank "$NODE_RANK" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${PORT:-29555}" --rdzv-id "${JOB:-flexsp-testbed}" \
  --rdzv-conf "is_host=$IS_HOST" --local-addr "$NODE_ADDR" "$@"
