# 使用 torchrun 启动 DDP 训练
# 为什么用 torchrun 而非 torch.distributed.launch？
# torchrun 是官方推荐的新启动方式，支持自动重启、
# 弹性训练和更清晰的日志输出
#   --nproc_per_node=4          每台机器 4 张 GPU
#   --nnodes=2                  2 台机器
#   --node_rank=0               当前机器编号
#   --master_addr=10.0.0.1      主节点地址
#   --master_port=29500         通信端口
torchrun \
    --nproc_per_node=4 \
    --nnodes=2 \
    --node_rank=0 \
    --master_addr=10.0.0.1 \
    --master_port=29500 \
    train.py --config config.yaml
