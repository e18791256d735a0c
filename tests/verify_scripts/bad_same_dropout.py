"""Broken (dropout): one seed on every rank, so torch's global generator is in the same state on
every rank when the model's forward draws its dropout masks, and each step drops the same units on
every rank. The data split is right (DistributedSampler) and the replicas agree."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
torch.manual_seed(0)  # bug: the only seed, the same on every rank; dropout draws from it below
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
sampler = DistributedSampler(data, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=8, sampler=sampler)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
dist.destroy_process_group()
