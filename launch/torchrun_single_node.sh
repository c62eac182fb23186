#!/usr/bin/env bash
# Single-node launch: one process per GPU (or NPROC_PER_NODE processes on CPU, gloo).
#
#   launch/torchrun_single_node.sh configs/tiny_cpu.yaml [key=value ...]
#   NPROC_PER_NODE=8 launch/torchrun_single_node.sh configs/qwen3_30b_a3b_gspo.yaml rl.steps=200
#
# The script `exec`s torchrun, so a scheduler's SIGTERM reaches torchrun and, through it, only the ranks it
# started; it never looks for or kills other processes.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 CONFIG.yaml [key=value ...]" >&2
  exit 2
fi
source "$(dirname "$0")/common.sh"
shift
exec "$python" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$NPROC_PER_NODE" \
  -m megagspo.cli train --config "$config" "$@"
