"""Broken (noise in the loop): one seed on every rank, then input noise drawn with torch.randn_like
inside the training loop, so every rank adds the same noise to its i-th batch. The data split is
right (DistributedSampler) and the replicas agree."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)  # bug: the only seed, the same on every rank; the loop draws from it below
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
sampler = DistributedSampler(data, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=8, sampler=sampler)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        x = x + 0.1 * torch.randn_like(x)  # noise augmentation
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
del model, optimizer
dist.destroy_process_group()
