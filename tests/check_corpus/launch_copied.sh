#!/usr/bin/env bash
# Launch commands as they get copied between READMEs, blog posts and chat answers.
set -euo pipefail

# Two nodes, each line explained in place: breaks the command after its first option.
torchrun \
    --nnodes=2 \        # machines
    --nproc_per_node=8 \
    --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" --master_port=29500 \
    train.py --epochs 10

# The old launcher, still in many READMEs.
python -m torch.distributed.launch --nproc_per_node=4 --use_env train.py --epochs 10

# Options after the script name: torchrun starts one process, train.py gets --nproc_per_node.
torchrun train.py --nproc_per_node=4 --epochs 10

# Fine: options first, the script's own arguments after it, comments on their own lines.
# (a blank after a backslash in a quoted string or a comment is no continuation: "a \ # b")
echo "torchrun \ # not a command, just text"
CUDA_VISIBLE_DEVICES=0,1 OMP_NUM_THREADS=4 torchrun --standalone --nproc-per-node 2 \
    train.py --nnodes-of-my-own 3 --lr 0.1
