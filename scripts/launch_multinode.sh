#!/usr/bin/env bash
# Start scripts/train_ddp.py on several machines: run this once on EVERY node.
#
#   head node:   NNODES=2 NODE_RANK=0 MASTER_ADDR=head-hostname bash scripts/launch_multinode.sh --epochs 10
#   other node:  NNODES=2 NODE_RANK=1 MASTER_ADDR=head-hostname bash scripts/launch_multinode.sh --epochs 10
#
# Arguments after the script name go to train_ddp.py. DRY_RUN=1 prints the command instead.
# Every node must reach the others over TCP on the cluster network, not only MASTER_ADDR:MASTER_PORT:
# only the rendezvous uses MASTER_PORT; NCCL and gloo connect the ranks on ephemeral ports (allow TCP
# between the nodes, not one port in the firewall). Every node must also see the same code and data
# paths and, for --ckpt-dir, share the checkpoint folder (rank 0 writes it).
# Comments never follow a trailing backslash below: `cmd \  # note` ends the command there.
set -euo pipefail

NNODES="${NNODES:-2}"                   # machines in the job
NODE_RANK="${NODE_RANK:?set NODE_RANK: 0 on the head node, 1..NNODES-1 elsewhere}"
NPROC_PER_NODE="${NPROC_PER_NODE:-gpu}" # "gpu" = one process per GPU; a number on CPU nodes
MASTER_ADDR="${MASTER_ADDR:?set MASTER_ADDR to the hostname or IP of the head node}"
MASTER_PORT="${MASTER_PORT:-29500}"
PYTHON="${PYTHON:-python}"              # the interpreter with torch installed
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

cmd=(
  "$PYTHON" -m torch.distributed.run
  --nnodes="$NNODES"
  --node_rank="$NODE_RANK"
  --nproc_per_node="$NPROC_PER_NODE"
  --master_addr="$MASTER_ADDR"
  --master_port="$MASTER_PORT"
  "$HERE/train_ddp.py" "$@"
)

if [[ "${DRY_RUN:-0}" == "1" ]]; then
  printf '%q ' "${cmd[@]}"
  echo
else
  exec "${cmd[@]}"
fi
