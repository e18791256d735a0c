"""Broken (functions): a batch with a non-finite loss is skipped on the rank that saw it, so that
rank runs one all-reduce fewer and the other waits for it forever."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(model, optimizer, batches, rank):
    total = torch.zeros(2)
    for i, x in enumerate(batches):
        loss = model(x).pow(2).mean()
        if rank == 1 and i == 2:
            loss = loss * float("nan")  # a bad batch, seen by one rank only
        if not torch.isfinite(loss):
            continue  # skip it: only on the rank that saw it
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += torch.tensor([loss.item(), 1.0])
    return total


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    total = train(model, optimizer, [torch.randn(8, 4) for _ in range(5)], rank)
    dist.all_reduce(total)
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
