"""Mixed precision that works on old and new torch: torch.amp first, torch.cuda.amp only where
torch.amp is missing (an import fallback and a feature check).

    torchrun --nproc_per_node=2 amp_fallback.py
"""
import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

try:
    from torch.amp import autocast
except ImportError:  # torch < 1.10
    from torch.cuda.amp import autocast


def make_scaler(enabled):
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda", enabled=enabled)
    return torch.cuda.amp.GradScaler(enabled=enabled)


def main():
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=datetime.timedelta(minutes=5))
    model = DDP(torch.nn.Linear(8, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler(torch.cuda.is_available())
    for step in range(10):
        with autocast("cuda", enabled=torch.cuda.is_available()):
            loss = model(torch.randn(4, 8)).pow(2).mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
