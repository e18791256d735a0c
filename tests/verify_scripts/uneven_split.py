"""Correct on 2 ranks, broken on 3 (plain script): a hand-made contiguous split of len // world
samples per rank drops the remainder, which only shows when the world size does not divide 64."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
per = len(data) // world  # bug: 64 // 3 = 21, so sample 63 is never used
loader = DataLoader(Subset(data, range(rank * per, (rank + 1) * per)), batch_size=8, shuffle=True)
model = DDP(nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
del model, optimizer
dist.destroy_process_group()
