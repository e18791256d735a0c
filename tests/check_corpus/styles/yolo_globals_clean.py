"""YOLO-shaped module globals: the same seed while the model is built, the global rank for saving."""
import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

LOCAL_RANK = int(os.getenv("LOCAL_RANK", -1))
RANK = int(os.getenv("RANK", -1))
WORLD_SIZE = int(os.getenv("WORLD_SIZE", 1))


def init_seeds(seed=0):
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def train(opt, device):
    init_seeds(opt.seed)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.SiLU()).to(device)
    if RANK != -1:
        model = DDP(model, device_ids=[LOCAL_RANK], output_device=LOCAL_RANK)
    init_seeds(opt.seed + 1 + RANK)
    for epoch in range(opt.epochs):
        if RANK in {-1, 0}:
            torch.save({"epoch": epoch, "model": model.module.state_dict()}, "last.pt")


if __name__ == "__main__":
    if LOCAL_RANK != -1:
        torch.cuda.set_device(LOCAL_RANK)
        dist.init_process_group(backend="nccl" if dist.is_nccl_available() else "gloo",
                                timeout=datetime.timedelta(seconds=10800))
