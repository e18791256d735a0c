# The engineering article, section 3.4, fixed: the loader does what its comment says (rank 0
# reads the file, every rank gets it by broadcast). Call save_checkpoint on rank 0 only.
import torch
import torch.distributed as dist


def save_checkpoint(model, optimizer, scaler, epoch, path="checkpoint.pt"):
    """保存 DDP 训练的 Checkpoint"""
    torch.save({
        "epoch": epoch,
        "model_state_dict": model.module.state_dict(),
        "optimizer_state_dict": optimizer.state_dict(),
        "scaler_state_dict": scaler.state_dict(),
    }, path)


def load_checkpoint(model, optimizer, scaler, path):
    """恢复 DDP 训练的 Checkpoint"""
    # 只在 rank 0 上加载，再广播到其他 GPU
    box = [None]
    if dist.get_rank() == 0:
        box[0] = torch.load(path, map_location="cpu")  # load_state_dict copies to each rank's device
    dist.broadcast_object_list(box, src=0)  # every rank calls it
    ckpt = box[0]

    model.module.load_state_dict(ckpt["model_state_dict"])
    optimizer.load_state_dict(ckpt["optimizer_state_dict"])
    scaler.load_state_dict(ckpt["scaler_state_dict"])
    return ckpt["epoch"]
