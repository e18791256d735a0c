#!/bin/bash
# Two experiments side by side on one 8-GPU machine, each torchrun choosing its own free port.
export OMP_NUM_THREADS=4
CUDA_VISIBLE_DEVICES=0,1,2,3 nohup torchrun --standalone --nproc_per_node=4 train.py --config a.yaml > a.out 2>&1 &
CUDA_VISIBLE_DEVICES=4,5,6,7 nohup torchrun --standalone --nproc_per_node=4 train.py --config b.yaml > b.out 2>&1 &
wait
