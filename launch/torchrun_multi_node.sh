#!/usr/bin/env bash
# Multi-node launch, run once on every node with the same arguments:
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node-a MASTER_PORT=29500 launch/torchrun_multi_node.sh RECIPE [k=v ...]
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node-a MASTER_PORT=29500 launch/torchrun_multi_node.sh RECIPE [k=v ...]
#
# NNODES, NODE_RANK and MASTER_ADDR are required; MASTER_PORT defaults to 29500, NPROC_PER_NODE to the
# node's GPU count. No host names are built in; the script `exec`s torchrun and starts nothing else.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: NNODES=.. NODE_RANK=.. MASTER_ADDR=.. $0 CONFIG.yaml [key=value ...]" >&2
  exit 2
fi
for var in NNODES NODE_RANK MASTER_ADDR; do
  if [ -z "${!var:-}" ]; then
    echo "$0: environment variable $var is required (NNODES, NODE_RANK, MASTER_ADDR; MASTER_PORT optional)" >&2
    exit 2
  fi
done
source "$(dirname "$0")/common.sh"
shift
exec "$python" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --nproc-per-node "$NPROC_PER_NODE" --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" \
  -m megagspo.cli train --config "$config" "$@"
