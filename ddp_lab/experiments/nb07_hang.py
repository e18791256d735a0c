"""A training loop that hangs: the loss is reduced for logging inside `if rank == 0:` (notebook 07).

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb07_hang

Rank 0 waits in an all_reduce that rank 1 never calls; with DDP_LAB_TIMEOUT=5 gloo gives up after
5 s on every rank, and the launcher's autopsy says which rank waited where.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.engine import runtime


def train(rank: int, steps: int = 6, log_every: int = 3) -> None:
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()                            # every rank joins this all-reduce
        optimizer.step()
        if rank == 0 and step % log_every == 0:    # the bug: only rank 0 reduces the loss to log it
            dist.all_reduce(loss.detach())  # ddp-lab: ignore[DDP009] (the lesson's bug, on purpose)
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    del model


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    with runtime.distributed() as ctx:
        train(ctx.rank)


if __name__ == "__main__":
    main()
