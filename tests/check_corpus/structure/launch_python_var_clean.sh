#!/bin/bash
# Launches through the interpreter of a virtual environment, held in a variable.
set -euo pipefail
PY="${VENV:-.venv}/bin/python"
PYTHON=python3
"$PY" -m torch.distributed.run --standalone --nproc_per_node=2 train.py
$PYTHON -m torch.distributed.run --standalone --nproc_per_node=2 train.py --epochs 1
for seed in 1 2 3; do
    python3 -m torch.distributed.run --nproc_per_node=2 --master_port=$((29500 + seed)) train.py --seed "$seed" > "seed_$seed.log" 2>&1 &
done
wait
