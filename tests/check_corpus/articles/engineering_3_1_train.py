# The engineering article, section 3.1 "DDP 训练启动脚本", as published: only the `=`, quotes and `+`
# its scraped text lost are restored. build_model, build_dataset and compute_loss are the
# article's own placeholders.
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def setup_ddp():
    """初始化 DDP 环境"""
    # 为什么用环境变量初始化？torchrun 启动时会
    # 自动设置 RANK、WORLD_SIZE、MASTER_ADDR 等变量
    # 用 init_method="env://" 可以直接读取
    # 无需硬编码地址和端口
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return local_rank


def cleanup_ddp():
    """清理 DDP 资源"""
    dist.destroy_process_group()


def train_ddp(config):
    local_rank = setup_ddp()
    device = torch.device(f"cuda:{local_rank}")

    # 构建模型并包装为 DDP
    model = build_model(config).to(device)
    # 为什么用 device_id 参数？指定 device_id 后
    # DDP 在前向传播前自动将输入移到对应 GPU
    # 避免手动 .to(device) 的遗漏
    model = DDP(model, device_ids=[local_rank])

    # 数据加载：使用 DistributedSampler 保证每个 GPU
    # 拿到不同的数据分片
    dataset = build_dataset(config)
    sampler = DistributedSampler(
        dataset,
        num_replicas=dist.get_world_size(),
        rank=dist.get_rank(),
        shuffle=True
    )
    dataloader = DataLoader(
        dataset,
        batch_size=config.batch_size,
        sampler=sampler,
        num_workers=4,
        pin_memory=True  # 加速 CPU→GPU 数据传输
    )

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr)
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(config.epochs):
        # 每个 Epoch 必须设置 sampler 的 epoch
        # 否则每个 Epoch 的数据顺序相同
        sampler.set_epoch(epoch)
        model.train()

        for batch_idx, batch in enumerate(dataloader):
            inputs = batch["input"].to(device, non_blocking=True)
            labels = batch["label"].to(device, non_blocking=True)

            optimizer.zero_grad()

            # 混合精度训练
            with torch.cuda.amp.autocast():
                outputs = model(inputs)
                loss = compute_loss(outputs, labels)

            scaler.scale(loss).backward()
            # DDP 在 backward() 时自动同步梯度
            # 为什么不需要手动 all-reduce？DDP 在
            # backward 阶段通过 Hook 拦截梯度
            # 自动执行 AllReduce，对训练代码透明

            scaler.step(optimizer)
            scaler.update()

            if batch_idx % 100 == 0 and local_rank == 0:
                print(f"Epoch {epoch}, Step {batch_idx}, "
                      f"Loss: {loss.item():.4f}")

    if local_rank == 0:
        torch.save(model.module.state_dict(), "model_final.pt")

    cleanup_ddp()
