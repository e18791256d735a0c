# The engineering article, section 3.4 "Checkpoint 保存与恢复", as published: only the `=`,
# quotes and `+` its scraped text lost are restored.
import torch


def save_checkpoint(model, optimizer, scaler, epoch, path="checkpoint.pt"):
    """保存 DDP 训练的 Checkpoint"""
    # 为什么只保存 model.module？DDP 包装后的模型
    # 是 DDP 对象，state_dict 包含额外的 DDP 状态
    # model.module 是原始模型，state_dict 更干净
    torch.save({
        "epoch": epoch,
        "model_state_dict": model.module.state_dict(),
        "optimizer_state_dict": optimizer.state_dict(),
        "scaler_state_dict": scaler.state_dict(),
    }, path)


def load_checkpoint(model, optimizer, scaler, path, local_rank):
    """恢复 DDP 训练的 Checkpoint"""
    # 只在 rank 0 上加载，再广播到其他 GPU
    # 为什么不在每个 rank 上独立加载？文件 I/O
    # 并发访问可能导致竞争且浪费 I/O 带宽
    map_location = {"cuda:0": f"cuda:{local_rank}"}
    if local_rank == 0:
        ckpt = torch.load(path, map_location=map_location)
    else:
        ckpt = torch.load(path, map_location=map_location)

    model.module.load_state_dict(ckpt["model_state_dict"])
    optimizer.load_state_dict(ckpt["optimizer_state_dict"])
    scaler.load_state_dict(ckpt["scaler_state_dict"])
    return ckpt["epoch"]
