"""Clips the gradient norm to 0.01, which fires at step 1 on 1 rank and on 2: the gradient the
optimizer sees is the clipped one. Correct as it is; `--times-world` multiplies the loss by the
world size (the bug verify --scaling finds, clipping or not)."""
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
factor = dist.get_world_size() if "--times-world" in sys.argv else 1
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), 10 * torch.randn(64, 1))
sampler = DistributedSampler(data, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=8, sampler=sampler)
model = DDP(nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y) * factor
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01)
        optimizer.step()
del model, optimizer
dist.destroy_process_group()
