"""A DDP training loop that hangs, one way per argument; plain torch, no ddp_lab.

    hang_training.py nan      rank 1 skips a step whose loss is NaN (`continue`), rank 0 does not
    hang_training.py uneven   rank 0 has one batch more than rank 1, and no Join

HANG_PG_TIMEOUT (seconds, default 600): the process group's timeout.
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def train_skipping_nan(model, optimizer, loader, rank):
    total = torch.zeros(2)
    for step, x in enumerate(loader):
        loss = model(x).pow(2).mean()
        if rank == 1 and step == 2:
            loss = loss * float("nan")  # a bad batch, seen by one rank only
        if torch.isnan(loss):
            continue  # skip the bad batch: only on the rank that saw it
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += torch.tensor([loss.item(), 1.0])
    return total


def train(model, optimizer, loader):
    total = torch.zeros(2)
    for x in loader:
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += torch.tensor([loss.item(), 1.0])
    return total


def warm_up():
    """Import, before any collective, what the first DDP step would import lazily: seconds on a
    loaded machine, long enough for the other rank to run into the short process-group timeout
    in an earlier collective than the one this program means to hang in."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()


def main(how):
    warm_up()
    timeout = datetime.timedelta(seconds=float(os.environ.get("HANG_PG_TIMEOUT", 600)))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if how == "nan":
        total = train_skipping_nan(model, optimizer, [torch.randn(8, 4) for _ in range(4)], rank)
    else:  # rank 0 has one batch more
        total = train(model, optimizer, [torch.randn(8, 4) for _ in range(4 + (rank == 0))])
    dist.all_reduce(total)
    print(f"rank {rank} mean loss {total[0] / total[1]:.3f}", flush=True)
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
