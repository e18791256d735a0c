"""The smallest correct DDP program: copy it, then grow it into scripts/train_ddp.py.

    python scripts/minimal_ddp.py                                     # one process
    torchrun --standalone --nproc_per_node=2 scripts/minimal_ddp.py   # two processes
"""
import datetime
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def train(rank, world_size, device):
    g = torch.Generator().manual_seed(0)  # the same data on every rank; the sampler shards it
    X = torch.randn(1024, 20, generator=g)
    y = (X[:, :5].sum(1) > 0).long()
    dataset = TensorDataset(X, y)

    torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)

    for epoch in range(3):
        sampler.set_epoch(epoch)  # without it every epoch repeats the same order
        total = torch.zeros(2, device=device)  # [sum of losses, number of samples] on this rank
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients across ranks here
            optimizer.step()
            total += torch.stack([loss.detach() * len(yb), torch.tensor(float(len(yb)), device=device)])
        dist.all_reduce(total)  # every rank joins; rank 0 prints the global mean, not its own
        if rank == 0:
            print(f"epoch {epoch} loss {(total[0] / total[1]).item():.4f}", flush=True)

    if rank == 0:  # one writer; .module is the plain model, loadable without DDP
        torch.save(model.module.state_dict(), os.environ.get("MINIMAL_DDP_OUT", "minimal_ddp.pt"))
    dist.barrier()  # nobody exits before the file is written


def main():
    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; plain python gets a world of one.
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])  # picks the GPU on this node; rank picks the data shard
    # NCCL needs a GPU of its own for every process on this node; otherwise use the CPU and gloo.
    if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)):
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))  # a lost rank fails, not hangs
    try:
        train(rank, world_size, device)
        # The DDP model must be gone before the group is destroyed, or it can abort this rank at
        # exit ("terminate called without an active exception"). train() has returned, but its
        # frame may not be freed yet: torch's first optimizer lazily imports torch._dynamo, whose
        # import-time reference cycle (pytorch/pytorch#195586) pins the frames then on the stack
        # until Python's cycle collector runs. Run it now.
        gc.collect()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
