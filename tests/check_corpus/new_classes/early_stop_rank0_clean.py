"""Early stopping decided by rank 0's patience counter, then broadcast: every rank leaves the
epoch loop together."""
import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def validate(model, loader):
    total, count = torch.zeros(()), 0
    with torch.no_grad():
        for x, y in loader:
            total += torch.nn.functional.mse_loss(model(x), y, reduction="sum")
            count += len(y)
    stats = torch.stack([total, torch.tensor(float(count))])
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main(net, loader, val_loader, epochs, patience=3):
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank = int(os.environ["RANK"])
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    best, bad_epochs = float("inf"), 0
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        val_loss = validate(model, val_loader)
        if rank == 0:
            if val_loss < best:
                best, bad_epochs = val_loss, 0
                torch.save(model.module.state_dict(), "best.pt")
            else:
                bad_epochs += 1
            diverged = epoch == epochs // 2 and val_loss > 10 * best
            stop = torch.tensor(int(bad_epochs >= patience or diverged))
        else:
            stop = torch.tensor(0)
        dist.broadcast(stop, src=0)
        if stop.item():
            break
    dist.destroy_process_group()
