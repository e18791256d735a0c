"""One training loop, two ways for rank 1 to leave it before rank 0; plain torch, no ddp_lab.

    hang_loop_exit.py early_stop   rank 1's loss is below the threshold at once: it breaks out
                                   (its own decision), though its loader has batches left
    hang_loop_exit.py uneven       nobody converges, but rank 0's loader has one batch more

Either way rank 0 waits in the next step's collectives and rank 1 in the barrier after the loop
(a barrier, which gloo never pairs with an all-reduce: rank 1 still holds its loader when the
process group's timeout ends the hang). The loop's source is the same in both: only what the loaders held tells them apart.
HANG_PG_TIMEOUT (seconds, default 600): the process group's timeout.
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


def warm_up():
    """Import what the first DDP step would import lazily (see hang_training.py)."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()


def main(how):
    warm_up()
    timeout = datetime.timedelta(seconds=float(os.environ.get("HANG_PG_TIMEOUT", 600)))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(rank)
    samples = 8 * (4 + (how == "uneven" and rank == 0))
    scale = 0.001 if how == "early_stop" and rank == 1 else 1.0  # rank 1's data: a tiny loss at once
    data = TensorDataset(scale * torch.randn(samples, 4), scale * torch.randn(samples, 1))
    loader = DataLoader(data, batch_size=8)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1, bias=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    total = torch.zeros(2)
    print(f"rank {rank} ready", flush=True)
    for x, y in loader:
        loss = (model(x) - y).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += torch.tensor([loss.item(), 1.0])
        if loss.item() < 0.01:
            break  # converged: decided by this rank alone
    dist.barrier()  # every rank done training
    dist.all_reduce(total)
    print(f"rank {rank} mean loss {total[0] / total[1]:.3f}", flush=True)
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
