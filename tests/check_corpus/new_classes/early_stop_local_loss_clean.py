"""Each rank validates on its own shard, the [sum, count] is all-reduced, and every rank stops on
the same global loss in the same epoch."""
import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def evaluate(model, loader):
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            total += torch.nn.functional.mse_loss(model(x), y, reduction="sum").item()
            count += len(y)
    model.train()
    stats = torch.tensor([total, count], dtype=torch.float64)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def fit(model, optimizer, train_loader, val_loader, epochs, min_delta=1e-3):
    best = float("inf")
    for epoch in range(epochs):
        train_loader.sampler.set_epoch(epoch)
        for x, y in train_loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        val_loss = evaluate(model, val_loader)
        if val_loss > best - min_delta:
            return epoch
        best = val_loss
    return epochs


def main(net, train_set, val_set):
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    model = DDP(net)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_loader = DataLoader(train_set, batch_size=32, sampler=DistributedSampler(train_set))
    val_loader = DataLoader(val_set, batch_size=64, sampler=DistributedSampler(val_set, shuffle=False))
    fit(model, optimizer, train_loader, val_loader, epochs=50)
    dist.destroy_process_group()
