# The engineering article, section 3.1, fixed: backend from the device and a timeout, torch.amp,
# the global rank for "rank 0 does it", and the loss all-reduced before rank 0 prints it.
import datetime
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def setup_ddp():
    """初始化 DDP 环境"""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=5))
    local_rank = int(os.environ["LOCAL_RANK"])  # picks the GPU; the global rank is the identity
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    return local_rank


def cleanup_ddp():
    """清理 DDP 资源"""
    dist.destroy_process_group()


def train_ddp(config):
    local_rank = setup_ddp()
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")

    model = build_model(config).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)

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
        pin_memory=True
    )

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr)
    scaler = torch.amp.GradScaler(device.type)

    for epoch in range(config.epochs):
        sampler.set_epoch(epoch)
        model.train()

        for batch_idx, batch in enumerate(dataloader):
            inputs = batch["input"].to(device, non_blocking=True)
            labels = batch["label"].to(device, non_blocking=True)

            optimizer.zero_grad()

            with torch.amp.autocast(device.type):
                outputs = model(inputs)
                loss = compute_loss(outputs, labels)

            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

            if batch_idx % 100 == 0:
                loss_sum = torch.tensor([loss.item(), 1.0], device=device)
                dist.all_reduce(loss_sum)  # every rank joins; rank 0 prints the mean over ranks
                if rank == 0:
                    print(f"Epoch {epoch}, Step {batch_idx}, "
                          f"Loss: {(loss_sum[0] / loss_sum[1]).item():.4f}")

    if rank == 0:
        torch.save(model.module.state_dict(), "model_final.pt")
    dist.barrier()

    cleanup_ddp()
