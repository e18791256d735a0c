"""YOLO's train.py shape: LOCAL_RANK from the environment, and the data set fetched inside
`torch_distributed_zero_first(LOCAL_RANK)`, which holds every other rank at a barrier until the
first one has the files.

    torchrun --nproc_per_node=4 yolo_style_zero_first.py
"""
import datetime
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms

LOCAL_RANK = int(os.getenv("LOCAL_RANK", -1))
RANK = int(os.getenv("RANK", -1))


@contextmanager
def torch_distributed_zero_first(local_rank):
    if local_rank not in (-1, 0):
        dist.barrier(device_ids=[local_rank])
    yield
    if local_rank == 0:
        dist.barrier(device_ids=[0])


def build_loader(root, batch):
    with torch_distributed_zero_first(LOCAL_RANK):
        data = datasets.CIFAR10(root, train=True, download=True, transform=transforms.ToTensor())
    sampler = DistributedSampler(data, shuffle=True)
    return DataLoader(data, batch_size=batch, sampler=sampler), sampler


def train(epochs=3):
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    loader, sampler = build_loader("data", 64)
    model = DDP(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3072, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    if RANK in (-1, 0):
        torch.save(model.module.state_dict(), "last.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
