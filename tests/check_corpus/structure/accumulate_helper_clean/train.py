"""Gradient accumulation whose micro-steps run in a context chosen by a helper of another file."""
import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sync_utils import micro_step


def main(k=4):
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(32):
        x = torch.randn(16, 8)
        with micro_step(model, (step + 1) % k != 0):
            loss = model(x).pow(2).mean() / k
            loss.backward()
        if (step + 1) % k == 0:
            opt.step()
            opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
