# The survey article, sections 3.5 and 3.6: single-node and multi-node torchrun commands, as
# published (correct: nothing to report).
torchrun \
    --standalone \
    --nproc_per_node=4 \
    train_ddp.py

CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun \
    --standalone \
    --nproc_per_node=4 \
    train_ddp.py

# 在节点 0 上执行：
torchrun \
    --nnodes=2 \
    --nproc_per_node=4 \
    --node_rank=0 \
    --master_addr=192.168.1.10 \
    --master_port=29500 \
    train_ddp.py

# 在节点 1 上执行：
torchrun \
    --nnodes=2 \
    --nproc_per_node=4 \
    --node_rank=1 \
    --master_addr=192.168.1.10 \
    --master_port=29500 \
    train_ddp.py
