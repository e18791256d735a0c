#!/bin/bash
# A learning-rate sweep on one machine: every run logs to its own file, in the background.
set -euo pipefail
for lr in 0.1 0.03 0.01; do
    torchrun --nproc_per_node=2 --master_port=29500 train.py --lr "$lr" > "logs/lr_$lr.log" 2>&1 &
done
wait
