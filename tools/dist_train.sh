#!/usr/bin/env bash
# Distributed (DDP) training on one or more machines with torchrun and mmengine's `pytorch`
# launcher:
#   bash tools/dist_train.sh CONFIG NUM_PROCS [train.py options...]
# Multi-node: NNODES, NODE_RANK, MASTER_ADDR, PORT as for torchrun. Without GPUs the processes
# use the gloo backend (tools/train.py switches it).
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 CONFIG NUM_PROCS [tools/train.py options...]" >&2
    exit 2
fi
CONFIG=$1
NPROC=$2
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=${PYTHON:-python}
if [ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ]; then
    PY="$ROOT/.venv/bin/python"
fi

PYTHONPATH="$ROOT:${PYTHONPATH:-}" \
"$PY" -m torch.distributed.run \
    --nnodes="$NNODES" \
    --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" \
    --nproc_per_node="$NPROC" \
    --master_port="$PORT" \
    "$ROOT/tools/train.py" \
    "$CONFIG" \
    --launcher pytorch "${@:3}"
