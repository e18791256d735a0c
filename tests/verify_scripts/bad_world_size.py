"""Broken four ways, each the same on every rank, so the replicas agree: the loss is multiplied by
the world size (the gradient is N times one process's), the LR scheduler steps on every micro-batch
(4 times per optimizer step), the 21 validation samples, which DistributedSampler pads to 22 on 2
ranks, are counted with the repeated one, and the augmentation noise is the same on every rank (one
seed, drawn from torch's global generator while a batch is loaded)."""
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ACCUM = 4


class Noisy(TensorDataset):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x + 0.1 * torch.randn_like(x), y  # bug: the same noise on every rank (one seed for all)


dist.init_process_group("gloo")
world = dist.get_world_size()
torch.manual_seed(0)
train = Noisy(torch.randn(64, 8), torch.randn(64, 1))
val = TensorDataset(torch.randn(21, 8), torch.randn(21, 1))
sampler = DistributedSampler(train, shuffle=True, seed=0)
loader = DataLoader(train, batch_size=8, sampler=sampler)
val_loader = DataLoader(val, batch_size=8, sampler=DistributedSampler(val, shuffle=False))
model = DDP(nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
for epoch in range(4):
    sampler.set_epoch(epoch)
    for i, (x, y) in enumerate(loader):
        last = (i + 1) % ACCUM == 0
        with nullcontext() if last else model.no_sync():
            loss = nn.functional.mse_loss(model(x), y) / ACCUM * world  # bug: DDP averages already
            loss.backward()
        if last:
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()  # bug: per micro-batch, not per optimizer step
    total = torch.zeros(2)
    with torch.no_grad():
        for x, y in val_loader:
            total += torch.tensor([nn.functional.mse_loss(model(x), y, reduction="sum").item(), len(x)])
    dist.all_reduce(total)  # bug: counts the sample DistributedSampler repeats (22 of 21)
    if dist.get_rank() == 0:
        print(f"epoch {epoch}: validation loss {total[0] / total[1]:.4f} over {int(total[1])} samples")
del model, optimizer, scheduler
dist.destroy_process_group()
