"""The smallest correct DDP program: rung 1 of the ladder that ends in train_ddp.py.

    python scripts/minimal_ddp.py                                     # one process
    torchrun --standalone --nproc_per_node=2 scripts/minimal_ddp.py   # 2 processes (CPUs or GPUs)

Each rung is a small diff of the one before (notebook 06b shows the diffs): minimal_ddp.py ->
ddp2_metrics.py -> ddp3_checkpoint.py -> ddp4_amp_accum.py -> ddp5_errors.py ->
ddp6_checkpoint_errors.py -> ddp7_data_models.py -> ddp8_task.py -> train_ddp.py.
"""
import argparse
import datetime
import gc
import math
import os
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--epochs", type=int, default=3)
    a("--batch-size", type=int, default=32, help="per rank")
    a("--lr", type=float, default=0.05, help="for one process with --batch-size")
    a("--seed", type=int, default=0)
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup():
    """Join torchrun's group, or make a world of one so the same code runs unlaunched."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # picks the GPU; the global rank shards data
    # NCCL needs a GPU of its own for every process on this node; otherwise use the CPU and gloo.
    if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)):
        torch.cuda.set_device(local_rank)  # before init, so NCCL binds each process to its own GPU
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # NCCL binds this GPU at init (without device_id every barrier() warns it is guessing the GPU)
    device_id = device if device.type == "cuda" else None
    timeout = datetime.timedelta(seconds=300)  # a lost rank fails loudly, never hangs
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1, timeout=timeout, device_id=device_id)
    return rank, world_size, device, backend


def build_data(args, rank):
    """(training set, number of classes): the same data on every rank; the sampler shards it."""
    g = torch.Generator().manual_seed(1234)
    X = torch.randn(1024, 20, generator=g)
    y = (X[:, :5].sum(1) > 0).long()
    return TensorDataset(X, y), 2


def build_model(args, shape, classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), 64), nn.ReLU(), nn.Linear(64, classes))


def train(args, rank, world_size, device, backend):
    is_main = rank == 0
    train_set, classes = build_data(args, rank)
    shape = tuple(train_set[0][0].shape)  # one input sample's shape, read from the data itself

    torch.manual_seed(args.seed)  # identical init on every rank (DDP also broadcasts rank 0's)
    raw_model = build_model(args, shape, classes).to(device)  # unwrapped: what we save

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(raw_model.parameters(), lr=args.lr, momentum=0.9)
    model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None)
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total = torch.zeros(2, device=device)  # [sum of losses, number of samples] on this rank
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients across ranks here
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(total)  # every rank joins; rank 0 prints the global mean, not its own
        if is_main:
            print(f"epoch {epoch} loss {(total[0] / total[1]).item():.4f}", flush=True)
    if is_main:  # one writer; the unwrapped model loads without DDP
        torch.save(raw_model.state_dict(), os.environ.get("MINIMAL_DDP_OUT", "minimal_ddp.pt"))
    dist.barrier()  # nobody exits before the file is written


def main(argv=None):
    args = parse_args(argv)
    rank, world_size, device, backend = setup()
    try:
        train(args, rank, world_size, device, backend)
        # Seen with torch 2.14.1: train()'s frame (its DDP model, the gloo/NCCL state that holds)
        # can outlive its return. The first optimizer lazily imports torch._dynamo, and during that
        # import torch.fx.wrap keeps its own frame in a local: a reference cycle that pins every frame
        # then on the stack until Python's cycle collector runs. Freed only at interpreter exit, after
        # destroy_process_group, the model aborts a finished rank ("terminate called without an active
        # exception"). Collect it now, while the group still exists; the line is harmless on a torch
        # without the cycle, and can go once a model local to train() is freed when train() returns.
        gc.collect()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
