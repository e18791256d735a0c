"""Broken (functions): a learning rate computed from the rank, so the replicas step differently."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_optimizer(model, rank):
    return torch.optim.SGD(model.parameters(), lr=0.05 * (rank + 1))  # bug: rank, not world size


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    sampler = DistributedSampler(data)
    model = DDP(nn.Linear(8, 1))
    optimizer = make_optimizer(model, dist.get_rank())
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=16, sampler=sampler):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
