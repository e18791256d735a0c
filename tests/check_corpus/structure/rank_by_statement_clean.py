"""Processes started by mp.spawn: the spawned index is handed to init_process_group as the rank,
and a helper reads the rank into a short name; every rank joins each collective, rank 0 alone prints."""
import datetime
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def evaluate(model, data):
    me = dist.get_rank()
    correct = torch.tensor([float((model(data).argmax(1) == 0).sum())])
    dist.all_reduce(correct)
    if me == 0:
        print(f"correct: {correct.item():.0f}")


def worker(idx, world):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=idx, world_size=world, timeout=datetime.timedelta(minutes=5))
    model = DDP(torch.nn.Linear(8, 2))
    evaluate(model, torch.randn(32, 8))
    dist.barrier()
    if idx == 0:
        print("evaluated")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    mp.spawn(worker, args=(2,), nprocs=2)
