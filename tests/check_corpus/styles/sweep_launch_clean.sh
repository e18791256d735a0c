#!/bin/bash
# A learning-rate sweep on one machine: each run gets its own port and log file.
set -euo pipefail
port=29500
for lr in 0.1 0.03 0.01; do
    torchrun --nproc_per_node=2 --master_port=$port train.py --lr "$lr" > "logs/lr_$lr.log" 2>&1 &
    port=$((port + 1))
done
wait
