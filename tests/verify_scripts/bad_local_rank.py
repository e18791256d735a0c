"""Broken (plain script): LOCAL_RANK passed as the sampler's rank. On one node it equals RANK; on a
cluster every node's first process draws the same shard."""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
local_rank = int(os.environ["LOCAL_RANK"])
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=local_rank)
loader = DataLoader(data, batch_size=16, sampler=sampler)
model = DDP(nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
del model, optimizer
dist.destroy_process_group()
