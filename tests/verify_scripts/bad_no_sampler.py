"""Broken (functions): no DistributedSampler, so every rank trains on the whole data set."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


def build_loader():
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    return DataLoader(data, batch_size=16, shuffle=True)


def train(model, loader, optimizer, epochs):
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1))
    train(model, build_loader(), torch.optim.SGD(model.parameters(), lr=0.1), epochs=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
