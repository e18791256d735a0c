"""Broken (EMA): an exponential moving average of the weights, updated on rank 0 alone. The
replicas agree (DDP keeps them equal) but the EMA copy, the model one evaluates and saves, is a
different model on each rank."""
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
sampler = DistributedSampler(data, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=8, sampler=sampler)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
ema = copy.deepcopy(model.module).requires_grad_(False)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if rank == 0:  # bug: the EMA moves on rank 0 only
            for e, p in zip(ema.parameters(), model.module.parameters()):
                e.mul_(0.9).add_(p.detach(), alpha=0.1)
del model, optimizer
dist.destroy_process_group()
