"""Correct (plain script): the training set is a Subset of the data (the rest is held out for
validation), sharded by DistributedSampler with set_epoch; the validation loss is reduced over
every rank. The held-out samples are no training sample any rank should draw."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

dist.init_process_group("gloo")
torch.manual_seed(0)
data = TensorDataset(torch.randn(80, 8), torch.randn(80, 1))
perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()  # same on every rank
train, val = Subset(data, perm[:64]), Subset(data, perm[64:])
sampler = DistributedSampler(train, shuffle=True, seed=0)
loader = DataLoader(train, batch_size=16, sampler=sampler)
val_loader = DataLoader(val, batch_size=16, sampler=DistributedSampler(val, shuffle=False))
model = DDP(nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        total = torch.zeros(2)
        for x, y in val_loader:
            total += torch.stack([nn.functional.mse_loss(model(x), y, reduction="sum"), torch.tensor(len(y))])
        dist.all_reduce(total)
del model, optimizer
dist.destroy_process_group()
