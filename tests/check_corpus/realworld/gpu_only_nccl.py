"""A GPU-only launcher: it stops with a clear message when there is no GPU, so "nccl" below is
never reached without one.

    torchrun --nproc_per_node=4 gpu_only_nccl.py
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def setup():
    if not torch.cuda.is_available():
        sys.exit("gpu_only_nccl.py trains on GPUs only: run it on a GPU node")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    return local_rank


def main():
    local_rank = setup()
    model = DDP(torch.nn.Linear(8, 8).cuda(local_rank), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10):
        loss = model(torch.randn(4, 8, device=local_rank)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
