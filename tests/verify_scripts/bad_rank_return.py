"""Broken (plain script): a helper leaves early on every rank but 0 before it steps the LR scheduler,
so from the second step on the ranks train with different learning rates."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def end_of_step(scheduler, loss):
    if dist.get_rank() != 0:  # bug: "only the main process logs", but the scheduler is below too
        return
    print(f"loss {loss.item():.4f}")
    scheduler.step()


dist.init_process_group("gloo")
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=16, sampler=sampler)
model = DDP(nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        end_of_step(scheduler, loss)
del model, optimizer, scheduler
dist.destroy_process_group()
