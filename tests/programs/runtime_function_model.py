"""A runtime program whose DDP model lives in a function, as in most real programs."""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.engine import runtime


def work(ctx):
    model = DDP(torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # the first optimizer: torch's lazy import
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    ctx.print0("trained")


def main():
    with runtime.distributed() as ctx:
        work(ctx)


if __name__ == "__main__":
    main()
